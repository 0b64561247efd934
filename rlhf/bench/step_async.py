"""`rlhf bench step --async`: synchronous against one-step-off-policy steps, side by side.

Both runs use the same job as `rlhf bench step` (model, prompts, sizes) on one training rank
and one rollout rank of its own (rollout.placement separate): first trainer.async_mode off
(sample, then train), then one_step (sample batch k+1 while batch k trains). Prints one JSON
line per run (mean seconds per timed step and per phase) and a summary: the synchronous run's
generate and train times, their sum and their max (the step time a perfect overlap reaches),
and the one-step-off step time against both.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

PHASES = ("step", "generate", "sync_weights", "wait_rollout", "update_actor", "ref", "reward")


def run(args: argparse.Namespace) -> int:
    from rlhf.bench.step import _job_config

    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("error: --steps must be at least 1 and --warmup at least 0")
    if args.cores < 2:
        raise SystemExit("error: --async needs --cores of at least 2 (a training rank and a "
                         "rollout rank)")
    args = argparse.Namespace(**{**vars(args), "ranks": 1})
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        base = _job_config(args, Path(tmp))
        for mode in ("off", "one_step"):
            cfg = _separate(base, mode, Path(tmp) / mode)
            lines.append({"system": f"async_mode={mode}", **_run(cfg, warmup=args.warmup)})
    sync, overlap = lines
    generate = sync["seconds"]["generate"]
    train = sync["seconds"]["step"] - generate - sync["seconds"]["sync_weights"]
    lines.append({
        "summary": args.model, "sync_s_per_step": sync["seconds"]["step"],
        "one_step_s_per_step": overlap["seconds"]["step"],
        "speedup": round(sync["seconds"]["step"] / overlap["seconds"]["step"], 3),
        "generate_s": round(generate, 4), "train_s": round(train, 4),
        "sum_generate_train_s": round(generate + train, 4),
        "max_generate_train_s": round(max(generate, train), 4),
        "timed_steps": args.steps, "warmup_steps": args.warmup, "cores": args.cores})
    for line in lines:
        print(json.dumps(line), flush=True)
    return 0


def _separate(cfg, mode: str, out: Path):
    """`cfg` on one training rank and one rollout rank, with trainer.async_mode `mode`."""
    from rlhf.config import config_from_dict, config_to_dict

    tree = config_to_dict(cfg)
    tree["rollout"].update(placement="separate", world_size=1)
    tree["trainer"].update(async_mode=mode, ranks_per_node=1, output_dir=str(out),
                           experiment_name=f"{cfg.trainer.experiment_name}-{mode}")
    return config_from_dict(tree)


def _run(cfg, *, warmup: int) -> dict:
    """The job's PPOTrainer steps; mean seconds per timed step of each phase."""
    from rlhf.bench.step import fit_job

    records = fit_job(cfg, warmup=warmup)

    def mean(key: str) -> float:
        return round(sum(r.get(key, 0.0) for r in records) / len(records), 4)

    out = {"seconds": {p: mean(f"timing/{p}") for p in PHASES},
           "rollout_seconds": mean("rollout/seconds"), "sync_gb_per_s": mean("sync/gb_per_s")}
    if cfg.trainer.async_mode != "off":
        out.update(actor_wait_s=mean("timing/wait_rollout"),
                   rollout_idle_s=mean("async/rollout_idle_s"),
                   staleness_mean=mean("async/staleness_mean"))
    return out

