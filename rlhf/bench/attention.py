"""Varlen attention kernels on this device against the fp32 reference: values, grads, speed.

Every kernel `rlhf.models.attention.pick_kernel` can choose here (sdpa_split always; on CUDA
flash-attn's `flash_varlen` where it is installed and torch's `torch_varlen` where this torch
has one) runs, in each dtype it serves, a packed batch of mixed lengths (empty and length-1
sequences included) with grouped-query k/v, with and without a shared prefix. Its output and
the grads of q, k and v are compared with `sdpa_varlen` in fp32 on the same device (TF32 off).
JSON lines:

- "agreement": one per kernel, dtype and case: max abs error of out, dq, dk, dv relative to the
  reference's largest magnitude, the tolerance of that dtype, `passed`, and whether
  `varlen_attention` picks this kernel for that dtype here (`chosen`).
- "speed" (CUDA): one bf16 forward and backward of each kernel on a 1B-like layer shape,
  `--tokens` in sequences of `--seq-len` ("equal") and in RL-like mixed lengths ("mixed",
  where sdpa_split cannot batch), median milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlhf.bench import print_checked
from rlhf.data.packing import SharedPrefix
from rlhf.engine import resolve_device
from rlhf.models.attention import _flash_fn, flash_varlen, pick_kernel, sdpa_split, sdpa_varlen
from rlhf.models.varlen_kernels import torch_varlen, torch_varlen_fn

# Largest error, relative to the reference's largest magnitude, that passes per dtype: a few
# roundings of the dtype (bf16 keeps 8 bits, fp16 11), fp32 kernels' summation order.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
LENGTHS = (37, 0, 1, 64, 5, 128, 64, 17)  # mixed, with an empty and a length-1 sequence
# Sequences 4 and 6 (lengths 5 and 64) also see the first 30 tokens of sequence 0.
PREFIX_STARTS = (0, 0, 0, 0, 0, 0, 0, 0)
PREFIX_LENS = (0, 0, 0, 0, 30, 0, 30, 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the speed shape")
    parser.add_argument("--seq-len", type=int, default=1024, help="sequence length of the speed shape")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    return print_checked(bench(args))


def kernels(device: torch.device) -> dict[str, tuple]:
    """name -> (kernel, dtypes it serves) for every kernel pick_kernel can choose here."""
    halves = (torch.bfloat16, torch.float16)
    out = {"sdpa_split": (sdpa_split, (torch.float32, *halves) if device.type == "cuda"
                          else (torch.float32, torch.bfloat16))}
    if device.type == "cuda" and _flash_fn() is not None:
        out["flash_varlen"] = (flash_varlen, halves)
    if device.type == "cuda" and torch_varlen_fn() is not None:
        out["torch_varlen"] = (torch_varlen, halves)
    return out


def bench(args: argparse.Namespace) -> list[dict]:
    from rlhf.verify import ieee_fp32

    device = resolve_device(args.device)
    lines = []
    with ieee_fp32():
        for name, (kernel, dtypes) in kernels(device).items():
            for dtype in dtypes:
                chosen = pick_kernel(device.type, dtype, flash_available=_flash_fn() is not None,
                                     torch_varlen_available=torch_varlen_fn() is not None)
                for shared in (False, True):
                    try:
                        line = agreement(kernel, dtype, device, shared=shared, args=args)
                    except Exception as exc:  # a kernel that raises is a failed check, not a crash
                        line = {"dtype": str(dtype).removeprefix("torch."), "shared_prefix": shared,
                                "error": f"{type(exc).__name__}: {exc}"[:300],
                                "tolerance": TOLERANCE[dtype], "passed": False}
                    lines.append({"bench": "attention", "kind": "agreement", "kernel": name,
                                  "chosen": chosen is kernel, **line})
        if device.type == "cuda":
            for shape in ("equal", "mixed"):
                for name, (kernel, _dtypes) in kernels(device).items():
                    try:
                        lines.append(speed(name, kernel, device, args, shape=shape))
                    except Exception as exc:
                        lines.append({"bench": "attention", "kind": "speed", "kernel": name,
                                      "shape": shape, "error": f"{type(exc).__name__}: {exc}"[:300]})
    return lines


def _inputs(args, device: torch.device, *, lengths, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T = sum(lengths)
    q = torch.randn(T, args.heads, args.head_dim, generator=gen)
    k, v = (torch.randn(T, args.kv_heads, args.head_dim, generator=gen) for _ in range(2))
    grad = torch.randn(T, args.heads, args.head_dim, generator=gen)
    return [x.to(device) for x in (q, k, v)], cu.to(device), max(lengths), grad.to(device)


def _forward_backward(kernel, qkv, cu, max_len, grad, *, dtype, prefix, scale):
    leaves = [x.detach().to(dtype).requires_grad_() for x in qkv]
    out = kernel(*leaves, cu_seqlens=cu, max_seqlen=max_len, causal=True, scale=scale,
                 prefix=prefix)
    out.backward(grad.to(dtype))
    return [out.detach()] + [x.grad for x in leaves]


def agreement(kernel, dtype: torch.dtype, device: torch.device, *, shared: bool,
              args) -> dict:
    """One kernel in one dtype against sdpa_varlen in fp32 on the same device."""
    qkv, cu, max_len, grad = _inputs(args, device, lengths=LENGTHS, seed=args.seed)
    prefix = SharedPrefix(torch.tensor(PREFIX_STARTS), torch.tensor(PREFIX_LENS)).to(device) \
        if shared else None
    scale = args.head_dim ** -0.5
    got = _forward_backward(kernel, qkv, cu, max_len, grad, dtype=dtype, prefix=prefix,
                            scale=scale)
    want = _forward_backward(sdpa_varlen, qkv, cu, max_len, grad, dtype=torch.float32,
                             prefix=prefix, scale=scale)
    errors = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        errors[name] = float((a.float() - b).abs().max() / b.abs().max().clamp(min=1e-6))
    tolerance = TOLERANCE[dtype]
    return {"dtype": str(dtype).removeprefix("torch."), "shared_prefix": shared,
            "relative_error": {k: float(f"{v:.3g}") for k, v in errors.items()},
            "tolerance": tolerance, "passed": max(errors.values()) <= tolerance}


def speed_lengths(tokens: int, seq_len: int, shape: str, seed: int = 0) -> list[int]:
    """`tokens` in sequences of `seq_len` ("equal") or of seeded lengths in [16, 2 seq_len)
    ("mixed"), the last one cut to fit."""
    if shape == "equal":
        return [seq_len] * max(1, tokens // seq_len)
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(int(torch.randint(16, 2 * seq_len, (1,), generator=gen)),
                           tokens - sum(lengths)))
    return lengths


def speed(name: str, kernel, device: torch.device, args, *, shape: str) -> dict:
    """Median ms of one bf16 forward and backward over `--tokens` (speed_lengths)."""
    lengths = speed_lengths(args.tokens, args.seq_len, shape, args.seed)
    qkv, cu, max_len, grad = _inputs(args, device, lengths=lengths, seed=args.seed)
    times = []
    for i in range(args.repeats + 1):  # the first call warms the kernels up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        _forward_backward(kernel, qkv, cu, max_len, grad, dtype=torch.bfloat16, prefix=None,
                          scale=args.head_dim ** -0.5)
        torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return {"bench": "attention", "kind": "speed", "kernel": name, "dtype": "bfloat16",
            "shape": shape, "tokens": sum(lengths), "sequences": len(lengths), "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim,
            "fwd_bwd_ms": round(1e3 * statistics.median(times), 3)}
