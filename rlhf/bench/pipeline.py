"""Pipeline schedules measured: bubble of 1F1B and interleaved 1F1B, packed versus padded.

Runs the real schedules (rlhf.engine.pipeline) in `--pp` gloo processes on a random-init tiny
Llama. Two kinds of JSON lines:

- "bubble": m equal micro-batches through 1F1B (vpp = 1) and interleaved 1F1B (vpp = --vpp).
  A stage's idle time is the time it spent blocked waiting for a neighbour's message; the
  measured bubble is that over the step's wall time (mean and max over stages), printed next
  to the theory (p - 1) / (m + p - 1) and (p - 1) / (v * m + p - 1).
- "packing": one RL-like batch (short prompts, long-tailed responses) through 1F1B, once as
  micro-batches planned under a token budget (rlhf.data.balancing, no padding) and once as the
  same number of micro-batches of equal sample counts padded to their longest sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlhf.config.schema import OptimizerConfig, ParallelConfig, TinyModelConfig
from rlhf.data.balancing import assign_micro_batches
from rlhf.data.ragged import Ragged
from rlhf.engine.engine import TrainEngine
from rlhf.engine.micro_batch import MicroBatch, make_micro_batches
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (processes)")
    parser.add_argument("--vpp", type=int, default=2, help="model chunks per stage, interleaved")
    parser.add_argument("--micro-batches", default="2,4,8",
                        help="comma-separated micro-batch counts m for the bubble runs")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512,
                        help="tokens per micro-batch in the bubble runs")
    parser.add_argument("--samples", type=int, default=64, help="samples in the packing batch")
    parser.add_argument("--budget", type=int, default=1024,
                        help="token budget per packed micro-batch in the packing runs")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before giving up")


def run(args: argparse.Namespace) -> int:
    counts = [int(m) for m in args.micro_batches.split(",") if m]
    if args.pp < 2:
        raise SystemExit("error: --pp must be at least 2 (a pipeline needs two stages)")
    if args.layers % (args.pp * args.vpp):
        raise SystemExit(f"error: --layers {args.layers} must be a multiple of pp * vpp = "
                         f"{args.pp * args.vpp}")
    # Imported here: it brings in transformers, which the CLI's parser (importing this module
    # for every `rlhf` command) does not need.
    from rlhf.demo.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                               num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64,
                               intermediate_size=2 * args.hidden, seed=args.seed)
        path = make_tiny_model(spec, Path(tmp) / "model")
        results = run_distributed(_worker, args.pp, str(path), vars(args), counts,
                                  timeout_s=args.timeout)
    for line in results[-1]:  # the last stage holds the losses; every stage reports its idle time
        print(json.dumps(line), flush=True)
    return 0


# ---- in each stage's process -------------------------------------------------------------------


def _worker(rank: int, world: int, path: str, opts: dict, counts: list[int]) -> list[dict]:
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    mesh = ParallelMesh(list(range(world)), pp=world, cache=ProcessGroupCache())
    lines = []
    for vpp in sorted({1, opts["vpp"]}):
        engine = _engine(path, mesh, vpp=vpp)
        schedule = "1f1b" if vpp == 1 else "interleaved"
        for m in counts:
            mbs = _equal_micro_batches(m, opts["tokens"], seed=opts["seed"])
            step_s, idle = _time(engine, mbs, opts["repeats"], mesh)
            p = world
            lines.append({"bench": "pipeline", "kind": "bubble", "schedule": schedule, "pp": p,
                          "vpp": vpp, "micro_batches": m, "tokens_per_micro_batch": opts["tokens"],
                          "step_s": round(step_s, 4),
                          "bubble_measured_mean": round(statistics.fmean(idle), 4),
                          "bubble_measured_max": round(max(idle), 4),
                          "bubble_theory": round((p - 1) / (vpp * m + p - 1), 4),
                          "peak_held_per_stage": _gather(engine.schedule.peak_held, mesh)})
    engine = _engine(path, mesh, vpp=1)
    lines += _packing(engine, opts, mesh)
    return lines


def _engine(path: str, mesh: ParallelMesh, *, vpp: int) -> TrainEngine:
    plan = ParallelConfig(pp=mesh.pp_size, vpp=vpp)
    return TrainEngine.from_pretrained(path, mesh=mesh, parallel=plan, optim=OptimizerConfig(),
                                       device="cpu", dtype="float32")


def _loss_fn(global_tokens: int):
    def loss_fn(out, mb: MicroBatch):
        mask_T = mb.tensors["mask"].bool()
        return -(out["log_probs"] * mask_T).sum() / global_tokens, {}
    return loss_fn


def _time(engine: TrainEngine, mbs: list[MicroBatch], repeats: int,
          mesh: ParallelMesh) -> tuple[float, list[float]]:
    """Median wall time of the schedule's forward_backward, and each stage's idle fraction."""
    tokens = max(1, sum(int(mb.tensors["mask"].sum()) for mb in mbs))
    walls, idles = [], []
    for i in range(repeats + 1):  # the first run warms up allocators and gloo connections
        torch.distributed.barrier(group=mesh.pp_group)
        start = time.perf_counter()
        engine.schedule.forward_backward(mbs, _loss_fn(tokens), outputs=("log_probs",))
        wall = time.perf_counter() - start
        engine.zero_grad()
        if i:
            walls.append(wall)
            idles.append(engine.schedule.last_wait_s / wall)
    step = statistics.median(walls)
    idle = statistics.median(idles)
    return _max_over_stages(step, mesh), _gather(idle, mesh)


def _gather(value, mesh: ParallelMesh) -> list:
    out = [None] * mesh.pp_size
    torch.distributed.all_gather_object(out, value, group=mesh.pp_group)
    return out


def _max_over_stages(value: float, mesh: ParallelMesh) -> float:
    return max(_gather(value, mesh))


# ---- batches -----------------------------------------------------------------------------------


def _equal_micro_batches(m: int, tokens: int, *, seed: int) -> list[MicroBatch]:
    """m micro-batches of 4 sequences of tokens/4 each (16-token prompts): equal work per stage."""
    g = torch.Generator().manual_seed(seed)
    length = tokens // 4
    prompts = [torch.randint(3, 500, (16,), generator=g) for _ in range(4 * m)]
    responses = [torch.randint(3, 500, (length - 16,), generator=g) for _ in range(4 * m)]
    return _with_mask(make_micro_batches(prompts, responses, max_tokens=4 * length))


def rl_like_lengths(n: int, *, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts 16-64 tokens, responses log-normal (median ~60)
    clipped to 4-400, the long tail that sampling at temperature 1 gives."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(16, 65, (n,), generator=g)
    responses = torch.exp(torch.randn(n, generator=g) * 0.9 + 4.1).clamp(4, 400).long()
    return list(zip(prompts.tolist(), responses.tolist()))


def _packing(engine: TrainEngine, opts: dict, mesh: ParallelMesh) -> list[dict]:
    lengths = rl_like_lengths(opts["samples"], seed=opts["seed"])
    g = torch.Generator().manual_seed(opts["seed"] + 1)
    prompts = [torch.randint(3, 500, (p,), generator=g) for p, _ in lengths]
    responses = [torch.randint(3, 500, (r,), generator=g) for _, r in lengths]
    budget = max(opts["budget"], max(p + r for p, r in lengths))
    assignment = assign_micro_batches([p + r for p, r in lengths], dp=1, max_tokens=budget)
    packed = [_one_micro_batch([prompts[i] for i in ids], [responses[i] for i in ids])
              for ids in assignment.rank(0)]
    m = len(packed)
    padded = []
    for ids in _even_split(len(lengths), m):
        longest = max(lengths[i][0] + lengths[i][1] for i in ids)
        padded.append(_one_micro_batch(
            [prompts[i] for i in ids],
            [torch.cat([responses[i], torch.zeros(longest - sum(lengths[i]), dtype=torch.int64)])
             for i in ids],
            real=[lengths[i][1] for i in ids]))
    real_tokens = sum(p + r for p, r in lengths)
    lines = []
    for mode, mbs in (("packed-planned", packed), ("padded", padded)):
        total = sum(mb.num_tokens for mb in mbs)
        step_s, _ = _time(engine, mbs, opts["repeats"], mesh)
        lines.append({"bench": "pipeline", "kind": "packing", "mode": mode, "schedule": "1f1b",
                      "pp": mesh.pp_size, "samples": len(lengths), "micro_batches": len(mbs),
                      "tokens_computed": total, "real_tokens": real_tokens,
                      "padding_fraction": round(1 - real_tokens / total, 4),
                      "step_s": round(step_s, 4)})
    lines.append({"bench": "pipeline", "kind": "packing-summary",
                  "padded_over_packed_step_time": round(lines[1]["step_s"] / lines[0]["step_s"], 3)})
    return lines


def _even_split(n: int, parts: int) -> list[range]:
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _one_micro_batch(prompts, responses, real: list[int] | None = None) -> MicroBatch:
    """One packed micro-batch of these sequences; `real` response lengths mask the padding."""
    mbs = make_micro_batches(prompts, responses, max_tokens=sum(p.numel() + r.numel()
                                                                for p, r in zip(prompts, responses)))
    assert len(mbs) == 1
    return _with_mask(mbs, real=real)[0]


def _with_mask(mbs: list[MicroBatch], real: list[int] | None = None) -> list[MicroBatch]:
    """Add tensors["mask"]: positions predicting a real (not padding) response token."""
    out = []
    for mb in mbs:
        mask_T = mb.predicts_response_T.clone()
        if real is not None:
            keep = Ragged(torch.cat([torch.arange(int(n)) < r for n, r in
                                     zip(mb.packed.response_lens.tolist(), real)]),
                          torch.cat([torch.zeros(1, dtype=torch.int64),
                                     mb.packed.response_lens.cumsum(0)]))
            mask_T[mask_T.clone()] = keep.values
        out.append(MicroBatch(mb.packed, {"mask": mask_T.float()}, mb.sample_ids))
    return out
