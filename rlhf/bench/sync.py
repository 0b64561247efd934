"""Weight sync throughput from a tp x pp training layout into vLLM (GB/s), beside a memcpy.

Every rank of the layout holds its shard in a TrainEngine and a vLLM replica of its own (as in
the actor's worker group with rollout.tp=1); a sync streams the exporter's size-bounded buckets
of full HF tensors into each replica. The time splits into gathering TP shards, broadcasting
pipeline stages and vLLM's reload (each the slowest rank's, from the best of the repeats).
The baseline copies the same number of bytes between two host buffers in one process.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from rlhf.config import RolloutConfig, TinyModelConfig
from rlhf.parallel.launch import run_distributed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model folder (default: a random tiny model)")
    parser.add_argument("--tp", type=int, default=1, help="training tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="training pipeline stages")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="export bucket size")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs (best is kept)")
    parser.add_argument("--layers", type=int, default=8, help="tiny model: layers")
    parser.add_argument("--hidden", type=int, default=512, help="tiny model: width")
    parser.add_argument("--kv-cache-gb", type=float, default=0.25, help="vLLM KV cache per rank")


def run(args: argparse.Namespace) -> int:
    if args.tp < 1 or args.pp < 1 or args.repeats < 1 or args.bucket_mb <= 0:
        raise SystemExit("--tp, --pp and --repeats must be at least 1, --bucket-mb positive")
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or tiny_model(Path(tmp), layers=args.layers, hidden=args.hidden)
        ranks = run_distributed(_sync_rank, args.tp * args.pp, str(folder), args.tp, args.pp,
                                int(args.bucket_mb * 2**20), args.repeats, args.kv_cache_gb,
                                timeout_s=600.0)
    best = ranks[0]  # the metrics are agreed over ranks: every rank returns the same
    moved, seconds = int(best["sync/bytes"]), best["sync/seconds"]
    memcpy_gb_per_s = moved / 1e9 / memcpy_seconds(moved, repeats=max(args.repeats, 5))
    gb_per_s = moved / 1e9 / seconds
    figures = {  # four significant figures: a slow sync under load must not print 0
        "seconds": seconds, "gather_s": best["sync/gather_s"],
        "broadcast_s": best["sync/broadcast_s"], "reload_s": best["sync/reload_s"],
        "gb_per_s": gb_per_s, "all_replicas_gb_per_s": len(ranks) * gb_per_s,
        "memcpy_gb_per_s": memcpy_gb_per_s, "of_memcpy": gb_per_s / memcpy_gb_per_s,
    }
    print(json.dumps({
        "bench": "sync", "tp": args.tp, "pp": args.pp, "bucket_mb": args.bucket_mb,
        "bytes_per_replica": moved, "replicas": len(ranks),
        **{k: float(f"{v:.4g}") for k, v in figures.items()},
    }), flush=True)
    return 0


def tiny_model(root: Path, *, layers: int, hidden: int) -> str:
    """A random Llama folder of the given depth and width (head size 64, a vLLM CPU size)."""
    from rlhf.demo.tiny_model import make_tiny_model

    cfg = TinyModelConfig(num_layers=layers, hidden_size=hidden, num_heads=max(hidden // 64, 1),
                          num_kv_heads=max(hidden // 128, 1), intermediate_size=hidden * 3,
                          vocab_size=512, max_position_embeddings=256)
    return str(make_tiny_model(cfg, root / "model"))


def memcpy_seconds(num_bytes: int, *, repeats: int) -> float:
    """Best time of copying `num_bytes` between two host buffers."""
    src = torch.ones(max(num_bytes // 4, 1), dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy also faults the pages in
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def _sync_rank(rank: int, world: int, folder: str, tp: int, pp: int, bucket_bytes: int,
               repeats: int, kv_cache_gb: float) -> dict[str, float]:
    """One rank: its training shard and vLLM replica; the sync metrics of the fastest sync."""
    import torch.distributed as dist

    from rlhf.engine import TrainEngine
    from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
    from rlhf.rollout import ReplicaSpec, RolloutReplica

    cache = ProcessGroupCache()
    mesh = ParallelMesh(range(world), tp=tp, pp=pp, cache=cache)
    engine = TrainEngine.from_pretrained(folder, mesh=mesh, dtype="float32", device="cpu")
    spec = ReplicaSpec(model_path=folder, config=RolloutConfig(cpu_kv_cache_gb=kv_cache_gb,
                                                               max_new_tokens=16),
                       device=torch.device("cpu"), dtype=torch.float32, max_model_len=64,
                       world_group=dist.group.WORLD, replica_group=None)
    replica = RolloutReplica(spec)
    replica.ensure_sampler()  # every rank at once: vLLM joins the job's world
    runs = []
    for _ in range(repeats):
        replica.mark_stale()
        runs.append(replica.sync(lambda: engine.export_hf_weights(bucket_bytes=bucket_bytes)))
    return min(runs, key=lambda metrics: metrics["sync/seconds"])
