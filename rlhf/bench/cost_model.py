"""Cost-model accuracy on fresh lengths, and step time with token_budget vs cost_model.

Profiles the job (`rlhf profile`, reused while its fingerprint matches unless
`--fresh-profile`), then draws `--batches` batches of `--samples` lengths from a log-normal
distribution (median `--median` tokens, spread `--sigma`, clipped to the role's budget): many
short sequences, a few very long, a distribution the profile's grid never saw. Each batch is
split both ways over the role's DP ranks (rlhf.data.batch_split: token_budget, and
cost_model with the role's measured cost), and every DP rank's pass (`--phase`) runs on one
replica of the role's layout (tp * pp processes), one rank after another, both modes' passes
back to back: the step's time is the slowest rank's pass, as DP ranks run side by side on
their own devices. Each cost-model micro-batch also runs alone. Prints (after `--details`'
line per run) one JSON line: median and p90 absolute relative error of the predicted
micro-batch times, pass times (pp > 1: the simulated schedule) and step times (the slowest
rank's, predicted against measured), the same error of one timed run against the next run of
the same pass (`repeat_*`: the machine's noise, the floor under any model's error) with the
load average at the end, the same errors once scaled by the run's one measured/predicted
factor (`load_scale`: a shared machine's speed when profiled and now differ), and the median
step time
of each mode with their micro-batch counts and predicted DP imbalance; with pp > 1 also the
cost-model plans' simulated step under 1F1B and under interleaved 1F1B (vpp = 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

import torch

from rlhf.data.batch_split import BatchSplit, split_batch
from rlhf.data.cost_model import Shape
from rlhf.data.micro_batching import predict_pass
from rlhf.plan import profile as prof


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="job config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--role", default="actor", help="the role whose passes run")
    parser.add_argument("--phase", choices=("forward", "forward_backward"),
                        default="forward_backward")
    parser.add_argument("--batches", type=int, default=3, help="fresh batches")
    parser.add_argument("--samples", type=int, default=32, help="samples per batch")
    parser.add_argument("--median", type=int, default=96, help="median sample length")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of lengths")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per pass (median)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fresh-profile", action="store_true",
                        help="profile again even where the fingerprint matches (a shared "
                             "machine's speed drifts between a profile and a later run)")
    parser.add_argument("--details", action="store_true",
                        help="first, one JSON line per pass and micro-batch run (predicted and "
                             "measured seconds)")


def run(args: argparse.Namespace) -> int:
    from rlhf.config import load_config
    from rlhf.config.paths import resolve_paths

    cfg = resolve_paths(load_config(args.config, args.overrides), base=Path.cwd())
    print(json.dumps(bench(cfg, args)), flush=True)
    return 0


def lengths(n: int, *, median: int, sigma: float, most: int, seed: int) -> list[int]:
    """Log-normal sample lengths (median `median`, spread `sigma`) clipped to [4, most]."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=gen) * sigma + float(torch.log(torch.tensor(
        float(median)))))
    return raw.clamp(4, most).long().tolist()


def bench(cfg, args) -> dict:
    """The JSON line (module docstring)."""
    models, _ = prof.profile(cfg, roles=[args.role], force=args.fresh_profile,
                             progress=prof.Say("stderr"))
    specs = prof.job_fingerprints(cfg)
    if args.role not in specs:
        raise SystemExit(f"error: the job has no role {args.role!r}; it has {sorted(specs)}")
    spec, fp = specs[args.role]
    cost = models.roles[args.role]
    role = getattr(cfg, args.role)
    from rlhf.trainer.step_splits import cost_plan

    plan = cost_plan(role, cost, args.phase)
    batches = [lengths(args.samples, median=args.median, sigma=args.sigma, most=spec.tokens,
                       seed=args.seed + b) for b in range(args.batches)]
    splits = {mode: [split_batch(b, dp=spec.dp, max_tokens=spec.tokens,
                                 cost_plan=plan if mode == "cost_model" else None)
                     for b in batches] for mode in ("token_budget", "cost_model")}
    jobs, keys = [], []
    # The two modes' passes of one batch and rank run back to back, so a change in the
    # machine's load during the run slows both alike.
    for b in range(len(batches)):
        for g in range(spec.dp):
            for mode, per_batch in splits.items():
                micro = _rank_micro_batches(per_batch[b], batches[b])[g]
                jobs.append((args.phase, micro))
                keys.append(("pass", mode, b, g))
                if mode == "cost_model":
                    for mb in micro:
                        jobs.append((args.phase, [mb]))
                        keys.append(("micro", mode, b, g))
    folders = prof.ModelFolders(cfg)
    try:
        ranks = prof.run_on_layout(spec, folders.of(spec), jobs, repeats=args.repeats,
                                   threads=fp["threads"])
    finally:
        folders.close()
    wall = [max(r["wall"][k] for r in ranks) for k in range(len(jobs))]
    # How well one timed run of a pass predicts the next run of the very same pass: the
    # machine's own noise, the floor under any model's error.
    runs = [[max(r["walls"][k][i] for r in ranks) for i in range(len(ranks[0]["walls"][k]))]
            for k in range(len(jobs))]
    repeat_err = [_rel(w[0], w[1]) for w in runs if len(w) > 1]
    pairs: dict[str, list[tuple[float, float]]] = {"micro": [], "pass": [], "step": []}
    step: dict[str, list[float]] = {"token_budget": [], "cost_model": []}
    details = []
    for mode in splits:
        for b in range(len(batches)):
            rank_walls, rank_predicted = [], []
            for k, key in enumerate(keys):
                if key[1:3] != (mode, b):
                    continue
                predicted = predict_pass(plan, [Shape.of(mb) for mb in jobs[k][1]])
                details.append((*key, jobs[k][1], predicted, wall[k]))
                pairs[key[0]].append((predicted, wall[k]))
                if key[0] == "pass":
                    rank_walls.append(wall[k])
                    rank_predicted.append(predicted)
            step[mode].append(max(rank_walls))
            pairs["step"].append((max(rank_predicted), max(rank_walls)))
    if args.details:
        for kind, mode, b, g, micro, predicted, measured in details:
            print(json.dumps({"bench": "cost-model", "kind": kind, "mode": mode, "batch": b,
                              "dp_rank": g, "tokens": [sum(mb) for mb in micro],
                              "lengths": micro, "predicted_s": round(predicted, 4),
                              "measured_s": round(measured, 4)}), flush=True)
    schedules = _simulated_schedules(role, cost, args.phase, splits["cost_model"], batches)
    scale = statistics.median(m / p for p, m in pairs["micro"] + pairs["pass"])
    tb, cm = (statistics.median(step[m]) for m in ("token_budget", "cost_model"))
    return {"bench": "cost-model", "role": args.role, "phase": args.phase,
            "tp": spec.parallel.tp, "cp": spec.parallel.cp, "pp": spec.parallel.pp,
            "vpp": spec.parallel.vpp, "dp": spec.dp, "dtype": str(spec.dtype).removeprefix("torch."),
            "machine": fp["machine"], "threads": fp["threads"], "batches": len(batches),
            "samples": args.samples, "median_length": args.median, "sigma": args.sigma,
            "max_tokens": spec.tokens,
            **_errors(pairs, 1.0, ""),
            # The machine's speed now over its speed during the profile (one factor for the
            # run), and the errors left once predictions are scaled by it: what the model gets
            # wrong between shapes, which is all a plan's choices depend on.
            "load_scale": round(scale, 3), **_errors(pairs, scale, "_at_load_scale"),
            "repeat_median_abs_rel_error": _q(repeat_err, 0.5),
            "repeat_p90_abs_rel_error": _q(repeat_err, 0.9),
            "load_average": round(os.getloadavg()[0], 1),
            "micro_batches_measured": len(pairs["micro"]), "passes_measured": len(pairs["pass"]),
            "token_budget_fallbacks": sum(f for s in splits["cost_model"] for f in s.fallbacks),
            "step_s_token_budget": round(tb, 4), "step_s_cost_model": round(cm, 4),
            "speedup": round(tb / cm, 3),
            "micro_batches_token_budget": _mean_count(splits["token_budget"]),
            "micro_batches_cost_model": _mean_count(splits["cost_model"]),
            "predicted_imbalance_token_budget": _imbalance(splits["token_budget"], batches, plan),
            "predicted_imbalance_cost_model": _imbalance(splits["cost_model"], batches, plan),
            **schedules}


def _rank_micro_batches(split: BatchSplit, lengths: list[int]) -> list[list[list[int]]]:
    """Per DP rank, its micro-batches (one mini-batch) as sample lengths, in run order."""
    return [[[lengths[rows[i]] for i in mb] for mb in group.mini_batches[0]]
            for rows, group in zip(split.rows, split.groups)]


def _simulated_schedules(role, cost, phase: str, splits: list[BatchSplit],
                         batches: list[list[int]]) -> dict:
    """pp > 1: the median predicted step of the cost-model plans under 1F1B and interleaved
    1F1B at vpp = 2, the choice `parallel.vpp` makes when the model is built."""
    if role.parallel.pp == 1:
        return {}
    from rlhf.trainer.step_splits import cost_plan

    out = {}
    for vpp, name in ((1, "1f1b"), (2, "interleaved_vpp2")):
        other = dataclasses.replace(role, parallel=dataclasses.replace(role.parallel, vpp=vpp))
        plan = cost_plan(other, cost, phase)
        steps = [max(predict_pass(plan, [Shape.of(mb) for mb in micro])
                     for micro in _rank_micro_batches(split, lengths))
                 for split, lengths in zip(splits, batches)]
        out[f"simulated_step_s_{name}"] = round(statistics.median(steps), 4)
    return out


def _imbalance(splits: list[BatchSplit], batches: list[list[int]], plan) -> float:
    """Mean over batches of the slowest DP rank's predicted pass over the mean rank's."""
    out = []
    for split, lengths in zip(splits, batches):
        times = [predict_pass(plan, [Shape.of(mb) for mb in micro])
                 for micro in _rank_micro_batches(split, lengths)]
        out.append(max(times) / (sum(times) / len(times)))
    return round(statistics.fmean(out), 4)


def _mean_count(splits: list[BatchSplit]) -> float:
    return round(statistics.fmean(len(g.mini_batches[0]) for s in splits for g in s.groups), 2)


def _errors(pairs: dict[str, list[tuple[float, float]]], scale: float, suffix: str) -> dict:
    """Median and p90 relative error of (predicted * scale) against measured, per kind."""
    out = {}
    for kind, name in (("micro", "micro_batch"), ("pass", "pass"), ("step", "step")):
        errors = [_rel(p * scale, m) for p, m in pairs[kind]]
        out[f"{name}_median_abs_rel_error{suffix}"] = _q(errors, 0.5)
        out[f"{name}_p90_abs_rel_error{suffix}"] = _q(errors, 0.9)
    return out


def _rel(predicted: float, measured: float) -> float:
    return abs(predicted / measured - 1)


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)
