"""The weight export's collectives against unsharded references: one coalesced all-gather
returns every rank's tensors; a tp2 x pp2 export gives the checkpoint's exact tensors, each
once, with one all-gather per bucket and one broadcast per bucket."""

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlhf.config.schema import ParallelConfig, TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.models.build import build_model
from rlhf.models.export import export_full_hf_weights
from rlhf.parallel import collectives as C
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache

BUCKET_BYTES = 48 * 1024  # the embedding goes alone, layer matrices share buckets


def _rank_tensors(rank):
    """Tensors of mixed dtypes and sizes (one empty), different on every rank."""
    return [torch.full((2, 3), float(rank)), torch.arange(5, dtype=torch.bfloat16) + rank,
            torch.empty(0, 4), torch.tensor([[rank], [7], [-rank], [1]], dtype=torch.int64),
            torch.full((3,), 0.5 + rank, dtype=torch.float64)]


def _coalesced(rank, world):
    group = dist.new_group(list(range(world)))
    calls = []
    single = C._all_gather_single
    C._all_gather_single = lambda *a, **k: calls.append(1) or single(*a, **k)
    out = C.all_gather_coalesced(_rank_tensors(rank), group=group)
    C._all_gather_single = single
    return len(calls), [[t.clone() for t in ranks] for ranks in out]


def test_all_gather_coalesced_gives_every_ranks_tensors_in_one_collective():
    for calls, out in run_distributed(_coalesced, 3, timeout_s=120.0):
        assert calls == 1
        for i, ranks in enumerate(out):
            for r, got in enumerate(ranks):
                want = _rank_tensors(r)[i]
                assert got.dtype == want.dtype and torch.equal(got, want), (i, r)


def _export(rank, world, folder):
    mesh = ParallelMesh(list(range(world)), tp=2, pp=2, cache=ProcessGroupCache())
    built = build_model(folder, mesh=mesh, parallel=ParallelConfig(tp=2, pp=2), head="lm")
    model, table = built.model, built.table
    counts = {"all_gather": 0, "broadcast": 0}
    single, broadcast = C._all_gather_single, dist.broadcast

    def count(name, fn):
        return lambda *a, **k: counts.__setitem__(name, counts[name] + 1) or fn(*a, **k)

    C._all_gather_single = count("all_gather", single)
    dist.broadcast = count("broadcast", broadcast)
    try:
        stream = export_full_hf_weights(model, table, mesh, bucket_bytes=BUCKET_BYTES)
        buckets = [[(name, t.clone()) for name, t in bucket] for bucket in stream]
    finally:
        C._all_gather_single, dist.broadcast = single, broadcast
    split = {e.name for e in table.entries if e.shard is not None}  # this stage's TP splits
    gathered = sum(any(name in split for name, _ in bucket) for bucket in buckets)
    return counts, buckets, gathered, (stream.times.gather_s, stream.times.broadcast_s)


def test_tp2_pp2_export_is_exact_once_each_with_one_collective_per_bucket(tmp_path):
    # vocab 515: padded to 516 over tp=2; tied, so the LM head is the embedding, sent once
    spec = TinyModelConfig(arch="qwen3", num_layers=4, hidden_size=64, num_heads=4,
                           num_kv_heads=2, intermediate_size=96, vocab_size=515,
                           tie_embeddings=True, max_position_embeddings=64)
    folder = make_tiny_model(spec, tmp_path / "model")
    original = load_file(f"{folder}/model.safetensors")
    original.pop("lm_head.weight", None)
    results = run_distributed(_export, 4, str(folder), timeout_s=300.0)
    buckets = results[0][1]
    names = [name for bucket in buckets for name, _ in bucket]
    assert sorted(names) == sorted(original) and len(names) == len(set(names))
    assert len(buckets) > 4
    for counts, got, gathered, (gather_s, broadcast_s) in results:
        exported = {name: t for bucket in got for name, t in bucket}
        assert all(torch.equal(exported[n], original[n]) for n in original)
        assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in buckets]
        # every bucket is broadcast once; a stage all-gathers once per bucket holding its
        # TP-split tensors, and never for the other stage's buckets
        assert counts["broadcast"] == len(buckets)
        assert counts["all_gather"] == gathered > 0
        assert gather_s > 0 and broadcast_s > 0
