"""Context-parallel attention: Ulysses (all-to-all over heads) against the all-gather of K/V.

For each cp in `--cp`, `cp` local processes on gloo each hold their `ContextShard` of the same
packed stream (rlhf.parallel.context_parallel) and run one attention layer's forward and
backward (`varlen_attention` with random q, k, v and output grad, the same on every rank) with
both methods: `cp_attention=all_gather` (`context_layout`, the baseline) and
`cp_attention=ulysses` (`ulysses_layout`). Cases: every `--shapes` entry (query heads / KV
heads) on every stream of `--cases` ("long": one sequence of `--tokens`; "mixed": one of half
of them and 256-token ones filling the rest). Each rank's layout is built once, as the engine
builds it once per micro-batch for every layer; a warm-up runs first, then `--repeats` timed
rounds, the methods interleaved (their order alternating), each timed between two barriers
(so the slowest rank's time).

One JSON line per (cp, shape, stream): median ms per forward+backward of each method and
their ratio (ulysses / all_gather); the bytes each rank sends per layer for each method,
computed from the shapes (`rlhf.parallel.ulysses.bytes_sent`; forward, the backward sends as
much again); the bytes autograd saves for the backward on the worst rank (measured with
saved-tensor hooks, distinct storages: the activation memory the method adds between forward
and backward); the largest difference between the two methods' outputs and input grads over
real tokens (`passed` when it is within fp32 rounding).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from rlhf.bench import print_checked
from rlhf.models.attention import varlen_attention
from rlhf.models.varlen_layout import context_layout, ulysses_layout
from rlhf.parallel.context_parallel import plan_context_shard, shard_tokens
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.ulysses import bytes_sent

METHODS = ("all_gather", "ulysses")
MIXED_SHORT = 256  # tokens of each short sequence of the "mixed" stream
TOLERANCE = 1e-4  # of the largest output or grad magnitude: fp32 summation order


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="cp sizes (processes)")
    parser.add_argument("--shapes", nargs="+", default=["8/8", "8/2", "32/8"],
                        help="query heads / KV heads of each case")
    parser.add_argument("--cases", nargs="+", default=["long", "mixed"],
                        choices=["long", "mixed"], help="streams: one sequence, or a mixed pack")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of each stream")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1800.0,
                        help="limit of each cp size's run")


def run(args: argparse.Namespace) -> int:
    return print_checked(bench(args))


def stream_lengths(case: str, tokens: int) -> list[int]:
    """Sequence lengths of a stream of `tokens`: one sequence ("long"), or one of half of them
    and short ones filling the rest ("mixed")."""
    if case == "long":
        return [tokens]
    long = tokens // 2
    rest = tokens - long
    return [long] + [MIXED_SHORT] * (rest // MIXED_SHORT) + ([rest % MIXED_SHORT]
                                                              if rest % MIXED_SHORT else [])


def _shape(text: str) -> tuple[int, int]:
    heads, _, kv = text.partition("/")
    try:
        return int(heads), int(kv)
    except ValueError:
        raise ValueError(f"--shapes {text!r}: write query heads/KV heads, e.g. 32/8") from None


def bench(args: argparse.Namespace) -> list[dict]:
    shapes = [_shape(s) for s in args.shapes]
    cases = [(heads, kv, case) for heads, kv in shapes for case in args.cases]
    lines = []
    for cp in args.cp:
        results = run_distributed(_rank, cp, cases, args.tokens, args.head_dim, args.repeats,
                                  args.seed, timeout_s=args.timeout_s)
        for i, (heads, kv, case) in enumerate(cases):
            figures = results[0][i]  # rank 0's times run barrier to barrier: the slowest rank's
            lens = stream_lengths(case, args.tokens)
            local = plan_context_shard(lens, cp=cp, rank=0).num_local
            sent = bytes_sent(cp=cp, tokens_local=local, heads=heads, kv_heads=kv,
                              head_dim=args.head_dim, element_size=4)
            saved = {m: max(r[i]["saved_bytes"][m] for r in results) for m in METHODS}
            ms = figures["ms"]
            lines.append({
                "bench": "cp-attention", "cp": cp, "heads": heads, "kv_heads": kv,
                "head_dim": args.head_dim, "stream": case, "tokens": args.tokens,
                "sequences": len(lens), "tokens_per_rank": local, "dtype": "float32",
                "ms": {m: round(ms[m], 2) for m in METHODS}, "baseline": "all_gather",
                "ratio": round(ms["ulysses"] / ms["all_gather"], 3),
                "sent_bytes_per_layer_forward": sent, "sent_bytes_from": "shapes",
                "saved_for_backward_bytes": saved,
                "saved_ratio": round(saved["ulysses"] / saved["all_gather"], 3),
                "max_relative_difference": figures["difference"],
                "passed": figures["difference"] <= TOLERANCE})
    return lines


def _rank(rank: int, world: int, cases, tokens: int, head_dim: int, repeats: int,
          seed: int) -> list[dict]:
    return [_case(rank, world, heads, kv, stream_lengths(case, tokens), head_dim=head_dim,
                  repeats=repeats, seed=seed) for heads, kv, case in cases]


def _case(rank: int, world: int, heads: int, kv: int, lens: list[int], *, head_dim: int,
          repeats: int, seed: int) -> dict:
    """This rank's figures of one case: median ms per method, the two methods' difference
    (worst over ranks), the bytes saved for backward."""
    group = dist.group.WORLD
    shard = plan_context_shard(lens, cp=world, rank=rank)
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen) for h in (heads, kv, kv))
    grad = shard_tokens(torch.randn(tokens, heads, head_dim, generator=gen), shard)
    inputs = [shard_tokens(x, shard) for x in (q, k, v)]
    layouts = {"all_gather": context_layout(shard, group=group, device="cpu"),
               "ulysses": ulysses_layout(shard, lens, group=group, device="cpu")}
    bounds = torch.tensor(shard.query_bounds, dtype=torch.int32)

    def step(method: str) -> tuple[list[torch.Tensor], int]:
        """Forward and backward: (output and input grads, bytes saved for backward)."""
        x = [t.detach().requires_grad_() for t in inputs]
        saved: dict[int, int] = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = varlen_attention(*x, cu_seqlens=bounds, max_seqlen=shard.max_query,
                                 scale=head_dim ** -0.5, layout=layouts[method])
        y.backward(grad)
        return [y.detach(), *(t.grad for t in x if t.grad is not None)], sum(saved.values())

    real = shard.holds_token
    warm = {m: step(m) for m in METHODS}  # warm-up; the two must agree
    difference = max(float((a[real] - b[real]).abs().max() / b[real].abs().max())
                     for a, b in zip(warm["ulysses"][0], warm["all_gather"][0]))
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(repeats):
        for method in (METHODS if r % 2 == 0 else METHODS[::-1]):
            dist.barrier()
            start = time.perf_counter()
            step(method)
            dist.barrier()
            times[method].append((time.perf_counter() - start) * 1e3)
    worst = torch.tensor([difference])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"ms": {m: statistics.median(t) for m, t in times.items()},
            "difference": round(float(worst), 9),
            "saved_bytes": {m: warm[m][1] for m in METHODS}}
