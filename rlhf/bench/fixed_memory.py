"""Memory outside the caching allocator: CUDA context, NCCL communicators by kind, pinned host.

What `rlhf plan` adds beside the model's tensors, measured on this machine's first GPU. Each
case runs in a fresh child process so one case's context, communicators or host cache cannot
leak into the next. JSON lines:

- "context": device memory a process holds once CUDA is up (total - free - torch's reserve).
- "nccl": one per case (`lazy`: init_process_group without device_id, as before 2026-11-27;
  `device_id`: bound to the device, so sub-groups are split from the world communicator;
  `device_id_nvls0`: the same with NCCL_NVLS_ENABLE=0): free device memory taken by the world
  communicator's first collective and by each of `--groups` sub-groups', against the planner's
  reserve per communicator (ratio). One process, so one-rank communicators: multi-rank NVLS and
  P2P buffers need several GPUs.
- "pinned": host bytes pinned for the tensors of `--layers` Qwen2.5-7B-shaped layers in bf16,
  one pinned tensor each (`per_tensor`: PyTorch's caching host allocator rounds each block up
  to a power of two), one flat buffer of 512-byte aligned views from that allocator
  (`flat_caching`: rounded once, as a whole) and the same flat buffer as plain host memory
  page-locked with cudaHostRegister (`flat_register`: no rounding): resident-memory growth
  over bytes asked (ratio), first-pinning time and GB/s, and device-to-host copy GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from rlhf.engine.offload import host_layout

GIB = 1024**3
NCCL_CASES = ("lazy", "device_id", "device_id_nvls0")
PINNED_CASES = ("per_tensor", "flat_caching", "flat_register")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, default=3, help="sub-groups made after the world")
    parser.add_argument("--layers", type=int, default=4,
                        help="Qwen2.5-7B layers whose tensors are pinned (plus embeddings)")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child's one case


def run(args: argparse.Namespace) -> int:
    import torch

    if args.case is not None:
        print(json.dumps(_child(args)), flush=True)
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"kind": "skipped", "reason": "no CUDA device: every figure here is "
                          "device or pinned memory"}), flush=True)
        return 0
    ok = True
    for case in ("context", *(f"nccl:{c}" for c in NCCL_CASES),
                 *(f"pinned:{c}" for c in PINNED_CASES)):
        line = _spawn(case, args)
        ok = ok and "error" not in line
        print(json.dumps(line), flush=True)
    return 0 if ok else 1


def qwen7b_shard_numels(layers: int) -> list[int]:
    """Element counts of the tensors of `layers` Qwen2.5-7B decoder layers plus the untied
    embedding and head, as one rank at tp=1 holds them."""
    hidden, inter, kv, vocab = 3584, 18944, 512, 152064
    layer = [hidden * hidden, kv * hidden, kv * hidden, hidden, kv, kv,  # q, k, v + biases
             hidden * hidden, inter * hidden, inter * hidden, hidden * inter,  # o, mlp
             hidden, hidden]  # norms
    return [vocab * hidden] + layer * layers + [hidden, vocab * hidden]


def _spawn(case: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if case.endswith("nvls0"):
        env["NCCL_NVLS_ENABLE"] = "0"
    command = [sys.executable, "-m", "rlhf.cli", "bench", "fixed-memory", "--case", case,
               "--groups", str(args.groups), "--layers", str(args.layers)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"kind": case.split(":")[0], "case": case, "error": done.stderr[-2000:]}
    return json.loads(lines[-1])


def _child(args: argparse.Namespace) -> dict:
    kind, _, case = args.case.partition(":")
    if kind == "context":
        return _context()
    if kind == "nccl":
        return _nccl(case, groups=args.groups)
    return _pinned(case, layers=args.layers)


def _used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def _context() -> dict:
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    return {"kind": "context", "context_gib": (_used() - reserved) / GIB,
            "torch_reserved_gib": reserved / GIB, "device": torch.cuda.get_device_name(0)}


def _nccl(case: str, *, groups: int) -> dict:
    import torch
    import torch.distributed as dist

    try:
        from rlhf.plan.memory import NCCL_COMMUNICATOR_BYTES as planned
    except ImportError:  # the planner's constants were renamed; the figures stand alone
        planned = None
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    base = _used()
    store = dist.HashStore()
    kwargs = {"device_id": torch.device("cuda", 0)} if case.startswith("device_id") else {}
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, **kwargs)
    after_init = _used()
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    after_world = _used()
    sub = []
    for _ in range(groups):
        before = _used()
        group = dist.new_group([0])
        dist.all_reduce(x, group=group)
        torch.cuda.synchronize()
        sub.append((_used() - before) / GIB)
    dist.destroy_process_group()
    line = {"kind": "nccl", "case": case, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "init_gib": (after_init - base) / GIB, "world_gib": (after_world - base) / GIB,
            "subgroup_gib": sub, "nvls_enable": os.environ.get("NCCL_NVLS_ENABLE", "default")}
    if planned:
        line["planned_gib"] = planned / GIB
        line["world_vs_plan"] = (after_world - base) / planned
        line["subgroup_vs_plan"] = max(sub) * GIB / planned if sub else None
    return line


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _host_stats() -> dict:
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return {}
    out = stats()
    return {k: v for k, v in out.items() if "bytes" in k and k.endswith(".current")}


def _pinned(case: str, *, layers: int) -> dict:
    import torch

    numels = qwen7b_shard_numels(layers)
    elem = torch.tensor([], dtype=torch.bfloat16).element_size()
    nbytes = [n * elem for n in numels]
    asked = sum(nbytes)
    src = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in numels]
    torch.cuda.synchronize()
    rss0 = _rss()
    t0 = time.perf_counter()
    layout = host_layout(nbytes)  # the engine's offload layout: aligned views, whole pages
    starts, size = layout.offsets, layout.nbytes
    if case == "per_tensor":
        dst = [torch.empty(n, dtype=torch.bfloat16, pin_memory=True) for n in numels]
    else:
        flat = torch.empty(size, dtype=torch.uint8, pin_memory=case == "flat_caching")
        if case == "flat_register":
            err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
        dst = [flat[s:s + b].view(torch.bfloat16) for s, b in zip(starts, nbytes)]
    pin_s = time.perf_counter() - t0
    rss = _rss() - rss0
    stats = _host_stats()
    copies = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - t0)
    line = {"kind": "pinned", "case": case, "tensors": len(numels), "asked_gib": asked / GIB,
            "flat_gib": size / GIB, "pinned": all(d.is_pinned() for d in dst[:3]),
            "rss_growth_gib": rss / GIB, "rss_vs_asked": rss / asked, "pin_s": pin_s,
            "pin_gb_per_s": asked / pin_s / 1e9, "d2h_gb_per_s": asked / min(copies) / 1e9}
    line.update({f"host_{k}": v / GIB for k, v in stats.items()})
    return line
