"""ZeRO-1 (optim.distributed) against the non-distributed optimizer and the hand reference.

One launch of 4 gloo processes runs every case: for each, a ZeRO-1 engine and a
non-distributed engine of the same layout take three steps on the same micro-batches; the
ZeRO-1 engine is also checkpointed after two steps and resumed into a fresh engine (of the
same layout, of a smaller and a larger dp size, and without ZeRO-1: the optimizer state is
resharded) whose third step must match the uninterrupted engine's. The
pytest process computes the single-process reference (three steps of torch AdamW on the
unsharded model). Small buckets make the flat buffer hold several padded buckets.
"""

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlhf.config.schema import ParallelConfig, TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import MicroBatchResult, TrainEngine, make_micro_batches
from rlhf.engine import grads as grads_module
from rlhf.engine.metrics import reduce_metrics
from rlhf.errors import RLHFError
from rlhf.models.build import build_model
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import (OPTIM, SMALL, actor_loss_fn, exported, make_batch,
                                         max_param_error, reference_steps)

TOL, BF16_TOL = 1e-6, 2e-2
SEEDS, N_SAMPLES, MAX_SEQS = (21, 22, 23), 8, 2
BUCKET = 5000  # elements: the embedding alone, the layers in a few buckets, each padded
MODELS = {"llama": ("llama", False), "qwen3-tied": ("qwen3", True)}
# case -> model, number of ranks, ParallelConfig kwargs, dtype
CASES = {
    "dp2": ("llama", 2, {}, "float32"),
    "dp4": ("llama", 4, {}, "float32"),
    "dp4-tied": ("qwen3-tied", 4, {}, "float32"),
    "tp2-dp2-sp-tied": ("qwen3-tied", 4, dict(tp=2, sequence_parallel=True), "float32"),
    "pp2-dp2-tied": ("qwen3-tied", 4, dict(pp=2), "float32"),
    "pp2-vpp2-dp2": ("llama", 4, dict(pp=2, vpp=2), "float32"),
    "dp4-bf16": ("llama", 4, {}, "bfloat16"),
}
SCATTERED = ("dp2", "dp4-tied", "tp2-dp2-sp-tied", "pp2-vpp2-dp2")  # also run reduce-scattering


def _engine(folder, mesh, parallel, dtype, *, distributed, scatter_grads=None):
    built = build_model(folder, mesh=mesh, parallel=parallel, head="lm", dtype=getattr(torch, dtype))
    optim = dataclasses.replace(OPTIM, distributed=distributed)
    return TrainEngine(built, mesh, optim=optim, total_steps=10,
                       bucket_numel=BUCKET, scatter_grads=scatter_grads)


def _step(engine, seed):
    mbs = make_micro_batches(*_batch_fields(seed), max_tokens=1000, max_seqs=MAX_SEQS)
    local = mbs[engine.mesh.dp_rank::engine.mesh.dp_size]
    tokens, _ = engine.loss_normalizers(local, mask_key="loss_mask")
    metrics = engine.forward_backward(local, actor_loss_fn(tokens))
    return {**engine.step(), "loss": metrics["loss"]}


def _batch_fields(seed):
    batch = make_batch(seed, n=N_SAMPLES)
    return batch.prompts, batch.responses, batch.per_token


def _bytes(engine, kind):
    return sum(t.numel() * t.element_size() for t in engine.state_tensors()[kind])


def _run_case(mesh, folder, parallel, dtype, ckpt):
    zero = _engine(folder, mesh, parallel, dtype, distributed=True)
    plain = _engine(folder, mesh, parallel, dtype, distributed=False)
    stats = {"zero": [], "plain": []}
    for i, seed in enumerate(SEEDS):
        if i == 2:
            zero.save_checkpoint(ckpt)
            resumed = _engine(folder, mesh, parallel, dtype, distributed=True)
            resumed.load_checkpoint(ckpt)
            resumed_stats = _step(resumed, seed)
        stats["zero"].append(_step(zero, seed))
        stats["plain"].append(_step(plain, seed))
    same_state = all(torch.equal(a, b) for kind in ("masters", "optimizer")
                     for a, b in zip(zero.state_tensors()[kind], resumed.state_tensors()[kind]))
    return {"stats": stats, "zero": exported(zero), "plain": exported(plain),
            "resumed": exported(resumed), "resumed_stats": resumed_stats,
            "resumed_state_equal": same_state,
            "optimizer_bytes": (_bytes(zero, "optimizer"), _bytes(plain, "optimizer")),
            "master_bytes": (_bytes(zero, "masters"), _bytes(plain, "masters")),
            "buckets": len(zero.grads.part.buckets), "dp": mesh.dp_size}


def _scattered(folder, mesh, parallel, dtype):
    """The ZeRO-1 engine with NCCL's grad sync forced on gloo (reduce-scatter into the owned
    ranges): three steps, counting the reduce-scatters that ran."""
    engine = _engine(folder, mesh, parallel, dtype, distributed=True, scatter_grads=True)
    default = _engine(folder, mesh, parallel, dtype, distributed=True)
    calls = []
    real = grads_module.reduce_scatter_single

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    grads_module.reduce_scatter_single = counting
    try:
        stats = [_step(engine, seed) for seed in SEEDS]
    finally:
        grads_module.reduce_scatter_single = real
    return {"params": exported(engine), "stats": stats, "reduce_scatters": len(calls),
            "buckets": len(engine.grads.part.buckets), "default_scatters": default.grads.scatter}


def _resumed_elsewhere(folder, mesh, ckpt, *, distributed):
    """Load a checkpoint written at another dp size (or ZeRO-1 setting), take the third step."""
    engine = _engine(folder, mesh, ParallelConfig(), "float32", distributed=distributed)
    engine.load_checkpoint(ckpt)
    stats = _step(engine, SEEDS[2])
    return {"params": exported(engine), "grad_norm": stats["grad_norm"]}


def _missing_shard(folder, mesh, ckpt, root):
    """A ZeRO-1 checkpoint with the second rank's data file deleted: the error text."""
    if mesh.rank == 0:
        shutil.copytree(ckpt, f"{root}/broken")
        Path(f"{root}/broken/__1_0.distcp").unlink()
    dist.barrier()
    engine = _engine(folder, mesh, ParallelConfig(), "float32", distributed=True)
    try:
        engine.load_checkpoint(f"{root}/broken")
    except RLHFError as e:
        return str(e)
    return None


def _metrics(cache):
    """reduce_metrics over dp4 (a rank idle, metric names differing by rank) and pp2 x dp2
    (results on the last stage only)."""
    rank = dist.get_rank()
    dp4 = ParallelMesh([0, 1, 2, 3], cache=cache)
    mine = [] if rank == 3 else [MicroBatchResult(float(rank + 1), {f"m{rank % 2}": float(rank),
                                                                     "shared": 1.0})]
    pp2 = ParallelMesh([0, 1, 2, 3], pp=2, cache=cache)
    last = {1: [MicroBatchResult(1.0, {"x": 2.0})],
            3: [MicroBatchResult(2.0, {"x": 4.0, "y": 1.0})]}.get(rank, [])
    return (reduce_metrics(mine, dp4, device=torch.device("cpu")),
            reduce_metrics(last, pp2, device=torch.device("cpu")))


def _run_all(rank, world, folders, root):
    cache = ProcessGroupCache()
    results = {"metrics": _metrics(cache)}
    for name, (model, n, parallel_kw, dtype) in CASES.items():
        parallel = ParallelConfig(**parallel_kw)
        mesh = ParallelMesh(list(range(n)), tp=parallel.tp, pp=parallel.pp, cache=cache)
        if mesh.is_member:
            results[name] = _run_case(mesh, folders[model], parallel, dtype, f"{root}/{name}")
            if name in SCATTERED:
                results[f"{name}-scatter"] = _scattered(folders[model], mesh, parallel, dtype)
    dp2 = ParallelMesh([0, 1], cache=cache)
    dp4 = ParallelMesh([0, 1, 2, 3], cache=cache)
    llama = folders["llama"]
    if dp2.is_member:
        results["dp4-into-dp2"] = _resumed_elsewhere(llama, dp2, f"{root}/dp4", distributed=True)
    results["dp2-into-dp4"] = _resumed_elsewhere(llama, dp4, f"{root}/dp2", distributed=True)
    dp1 = ParallelMesh([0], cache=cache)  # one rank left: the default turns ZeRO-1 off
    if dp1.is_member:
        results["dp2-into-dp1"] = _resumed_elsewhere(llama, dp1, f"{root}/dp2", distributed=None)
    results["dp4-into-dp4-plain"] = _resumed_elsewhere(llama, dp4, f"{root}/dp4",
                                                       distributed=False)
    results["missing-shard"] = _missing_shard(llama, dp4, f"{root}/dp2", root)
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero")
    folders = {name: str(make_tiny_model(
        TinyModelConfig(arch=arch, tie_embeddings=tied, **{**SMALL, "num_layers": 4}),
        root / name)) for name, (arch, tied) in MODELS.items()}
    refs = {name: reference_steps(folders[name], [make_batch(s, n=N_SAMPLES) for s in SEEDS])
            for name in MODELS}
    results = run_distributed(_run_all, 4, folders, str(root / "ckpt"), timeout_s=600)
    return refs, results


@pytest.mark.parametrize("name", list(CASES))
def test_zero1_equals_the_non_distributed_optimizer_and_the_reference(setup, name):
    refs, results = setup
    model, n, _, dtype = CASES[name]
    ref = refs[model]
    assert ref["grad_norm"][0] > OPTIM.grad_clip  # clipping is active
    fp32 = dtype == "float32"
    tol = TOL if fp32 else BF16_TOL
    for rank in range(n):
        got = results[rank][name]
        assert max_param_error(got["zero"], got["plain"]) < tol, rank
        assert max_param_error(got["zero"], ref["params"]) < tol, rank
        assert max_param_error(got["plain"], ref["params"]) < tol, rank
        for zero, plain, want in zip(got["stats"]["zero"], got["stats"]["plain"],
                                     ref["grad_norm"]):
            rel = 1e-6 if fp32 else 1e-2
            assert zero["grad_norm"] == pytest.approx(plain["grad_norm"], rel=rel)
            assert zero["grad_norm"] == pytest.approx(want, rel=1e-5 if fp32 else 5e-2)


@pytest.mark.parametrize("name", SCATTERED)
def test_zero1_reduce_scatter_path_equals_the_replicated_optimizer(setup, name):
    """NCCL's branch (reduce-scatter into the owned ranges), forced on gloo."""
    refs, results = setup
    model, n, _, _ = CASES[name]
    for rank in range(n):
        got, case = results[rank][f"{name}-scatter"], results[rank][name]
        assert not got["default_scatters"]  # gloo's own choice is the all-reduce
        assert got["reduce_scatters"] == got["buckets"] * len(SEEDS), rank
        assert max_param_error(got["params"], case["plain"]) < TOL, rank
        assert max_param_error(got["params"], refs[model]["params"]) < TOL, rank
        for mine, plain in zip(got["stats"], case["stats"]["plain"]):
            assert mine["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
            assert mine["loss"] == pytest.approx(plain["loss"], rel=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_zero1_holds_one_dp_th_of_the_optimizer_state(setup, name):
    _, results = setup
    model, n, _, dtype = CASES[name]
    for rank in range(n):
        got = results[rank][name]
        zero, plain = got["optimizer_bytes"]
        dp, buckets = got["dp"], got["buckets"]
        assert buckets > 1
        # exact up to each bucket's padding to a multiple of dp (< 1 element per bucket per rank)
        assert plain / dp <= zero < plain / dp + 8 * buckets
        masters = got["master_bytes"]
        if dtype == "float32":
            assert masters == (0, 0)  # an fp32 model is its own master
        else:
            assert masters[1] / dp <= masters[0] < masters[1] / dp + 4 * buckets


@pytest.mark.parametrize("name", list(CASES))
def test_zero1_checkpoint_round_trip_is_exact(setup, name):
    _, results = setup
    for rank in range(CASES[name][1]):
        got = results[rank][name]
        assert got["resumed_state_equal"], rank
        assert got["resumed_stats"] == got["stats"]["zero"][2], rank
        for key, tensor in got["zero"].items():
            assert torch.equal(got["resumed"][key], tensor), (rank, key)


@pytest.mark.parametrize("name,saved,ranks", [("dp4-into-dp2", "dp4", 2),
                                               ("dp2-into-dp4", "dp2", 4),
                                               ("dp2-into-dp1", "dp2", 1),
                                               ("dp4-into-dp4-plain", "dp4", 4)])
def test_loading_at_another_dp_size_or_zero1_setting_reshards(setup, name, saved, ranks):
    _, results = setup
    want = results[0][saved]  # the engine that wrote the checkpoint, after its third step
    for rank in range(ranks):
        got = results[rank][name]
        assert max_param_error(got["params"], want["zero"]) < TOL, rank
        assert got["grad_norm"] == pytest.approx(want["stats"]["zero"][2]["grad_norm"],
                                                 rel=1e-6)


def test_a_missing_data_file_is_named(setup):
    _, results = setup
    for rank in range(4):
        message = results[rank]["missing-shard"]
        assert message and "__1_0.distcp is missing" in message, rank


def test_metrics_are_reduced_over_dp_and_broadcast_from_the_last_stage(setup):
    _, results = setup
    for rank in range(4):
        dp4, pp2 = results[rank]["metrics"]
        assert dp4 == {"loss": 6.0, "num_micro_batches": 3.0, "m0": 1.0, "m1": 1.0,
                       "shared": 1.0}
        assert pp2 == {"loss": 3.0, "num_micro_batches": 2.0, "x": 3.0, "y": 1.0}
