"""Show the grad sync overlapping the last backward: a torch.profiler trace of one training step
of two gloo ranks (dp=2, one thread each), with optim.overlap_grad_reduce on and off.

    PYTHONPATH=$PWD python examples/grad_overlap_trace.py [--layers 8 --hidden 512]

Prints, for each setting, rank 0's step time (median of --steps) and a text timeline of the
profiled step: when the last micro-batch's backward ran, and when each bucket's DP all-reduce
ran (from its `c10d` enqueue on the training thread to the end of its gloo work). With overlap
the all-reduces start inside the backward; without, all of them after it. Writes the Chrome
traces to --out (open in https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from rlhf.config.schema import OptimizerConfig
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.models.build import BuiltModel
from rlhf.models.config import ModelArgs
from rlhf.models.transformer import CausalLM
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache

WIDTH = 72  # characters of the timeline


def _engine(args, mesh, *, overlap: bool) -> TrainEngine:
    torch.manual_seed(0)
    model_args = ModelArgs.from_hf_config(dict(
        model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096))
    optim = dataclasses.replace(OptimizerConfig(), overlap_grad_reduce=overlap)
    return TrainEngine(BuiltModel.unsharded(CausalLM(model_args)), mesh, optim=optim,
                       bucket_numel=args.bucket)


def _micro_batches(args, rank: int):
    gen = torch.Generator().manual_seed(rank)
    n = args.micro_batches * args.seqs
    prompts = [torch.randint(0, args.vocab, (8,), generator=gen) for _ in range(n)]
    responses = [torch.randint(0, args.vocab, (args.seq_len - 8,), generator=gen)
                 for _ in range(n)]
    return make_micro_batches(prompts, responses, max_tokens=args.seqs * args.seq_len,
                              max_seqs=args.seqs)


def _step(engine, mbs):
    def loss_fn(out, mb):
        return -out["log_probs"].sum() / 1e4, {}
    engine.forward_backward(mbs, loss_fn, outputs=("log_probs",))
    engine.step()


def _rank(rank, world, args):
    from torch.profiler import ProfilerActivity, profile

    mesh = ParallelMesh(list(range(world)), cache=ProcessGroupCache())
    torch.set_num_threads(1)
    out = {}
    for overlap in (False, True):
        engine = _engine(args, mesh, overlap=overlap)
        mbs = _micro_batches(args, rank)
        _step(engine, mbs)  # warm-up
        walls = []
        for _ in range(args.steps):
            start = time.perf_counter()
            _step(engine, mbs)
            walls.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(engine, mbs)
        trace = Path(args.out) / f"overlap_{'on' if overlap else 'off'}_rank{rank}.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        out[overlap] = {"step_s": statistics.median(walls), "trace": str(trace),
                        "buckets": len(engine.grads.part.buckets)}
    return out


def _timeline(trace: str) -> tuple[list[str], dict]:
    events = [e for e in json.loads(Path(trace).read_text())["traceEvents"]
              if e.get("ph") == "X"]
    backward = next(e for e in events if e["name"] == "final_backward")
    reduces = sorted((e for e in events if e["name"] == "gloo:all_reduce"), key=lambda e: e["ts"])
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)

    def bar(start, dur, mark):
        a = int((start - t0) / (t1 - t0) * WIDTH)
        b = max(a + 1, int((start + dur - t0) / (t1 - t0) * WIDTH))
        return " " * a + mark * (b - a)

    lines = [f"{'last backward':<16}|{bar(backward['ts'], backward['dur'], '#'):<{WIDTH}}|"]
    for i, e in enumerate(reduces):
        lines.append(f"{f'all-reduce {i}':<16}|{bar(e['ts'], e['dur'], '='):<{WIDTH}}|")
    end_backward = backward["ts"] + backward["dur"]
    inside = sum(e["ts"] < end_backward for e in reduces)
    return lines, {"span_ms": round((t1 - t0) / 1e3, 1), "all_reduces": len(reduces),
                   "started_inside_backward": inside}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seqs", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=2**21, help="elements per grad bucket")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="/tmp/grad_overlap")
    args = parser.parse_args()
    result = run_distributed(_rank, 2, args, timeout_s=600)[0]
    for overlap in (False, True):
        got = result[overlap]
        lines, facts = _timeline(got["trace"])
        print(f"overlap_grad_reduce={str(overlap).lower()}: step {got['step_s']:.3f} s "
              f"(median of {args.steps}), {got['buckets']} buckets, profiled step "
              f"{json.dumps(facts)}")
        print("\n".join(lines))
        print()


if __name__ == "__main__":
    main()
