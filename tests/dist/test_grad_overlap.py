"""Grad sums overlapped with the last micro-batch's backward (optim.overlap_grad_reduce)
against the synchronous sync, bit for bit, in one launch of 4 gloo processes.

Each case builds the same engine twice, overlapped and not, and takes a step (two for the
dp2 cases: the sync starts afresh) on two or more micro-batches per rank (a sum started
during an earlier micro-batch would be wrong). The layouts: dp2 without ZeRO-1 and dp2 with
ZeRO-1 reduce-scattering (NCCL's branch on gloo) and recompute, side by side on ranks 0-1 and
2-3; tp2 x dp2 with sequence parallelism (TP-partial grads), pp2 x dp2 with tied embeddings
(the tied buckets sum after the tie), interleaved pp2 x vpp2 x dp2, and an MoE at ep2 x dp4
(the experts' buffer sums over edp).
"""

import dataclasses

import pytest
import torch

from rlhf.config.schema import ParallelConfig, TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.models.build import build_model
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.dist.test_moe_parallel import SPEC as MOE
from tests.unit.engine.reference import OPTIM, SMALL, actor_loss_fn, exported, make_batch

SEEDS, N_SAMPLES, MAX_SEQS = (31, 32), 8, 1
BUCKET = 5000  # several buckets, so some start while backward still runs
MODELS = {"llama": dict(arch="llama"), "qwen3-tied": dict(arch="qwen3", tie_embeddings=True)}
ALL = (0, 1, 2, 3)
# case -> model, ranks, ParallelConfig kwargs, ZeRO-1, forced reduce-scatter, recompute;
# cases of a run of `ALL` take turns, the two on ranks 0-1 and 2-3 run at once.
RUNS = [
    {"dp2": ("llama", (0, 1), {}, False, None, "none"),
     "dp2-zero-scatter-recompute-full": ("llama", (2, 3), {}, True, True, "full")},
    {"tp2-dp2-sp-zero-scatter": ("qwen3-tied", ALL, dict(tp=2, sequence_parallel=True), True,
                                 True, "none")},
    {"pp2-dp2-tied-zero-scatter": ("qwen3-tied", ALL, dict(pp=2), True, True, "none")},
    {"pp2-vpp2-dp2": ("llama", ALL, dict(pp=2, vpp=2), False, None, "none")},
    {"ep2-dp4-moe-zero": ("moe", ALL, dict(ep=2), True, None, "none")},
]
CASES = {name: case for run in RUNS for name, case in run.items()}


def _engine(folder, mesh, parallel, case, *, overlap):
    _, _, _, zero, scatter, recompute = case
    built = build_model(folder, mesh=mesh, parallel=parallel, head="lm", dtype=torch.float32)
    optim = dataclasses.replace(OPTIM, distributed=zero, overlap_grad_reduce=overlap)
    return TrainEngine(built, mesh, optim=optim, total_steps=10, bucket_numel=BUCKET,
                       scatter_grads=scatter, recompute=recompute)


def _steps(engine):
    out = []
    for seed in SEEDS[:2 if len(engine.mesh.ranks) == 2 else 1]:
        batch = make_batch(seed, n=N_SAMPLES)
        mbs = make_micro_batches(batch.prompts, batch.responses, batch.per_token,
                                 max_tokens=1000, max_seqs=MAX_SEQS)
        local = mbs[engine.mesh.dp_rank::engine.mesh.dp_size]
        assert len(local) >= 2
        tokens, _ = engine.loss_normalizers(local, mask_key="loss_mask")
        metrics = engine.forward_backward(local, actor_loss_fn(tokens))
        overlapped = [s.sync.overlapped_buckets for s in engine._sets]
        out.append({**engine.step(), "loss": metrics["loss"], "overlapped": overlapped})
    return out


def _run_all(rank, world, folders):
    cache = ProcessGroupCache()
    results = {}
    for run in RUNS:
        for name, case in run.items():
            model, ranks, parallel_kw, *_ = case
            parallel = ParallelConfig(**parallel_kw)
            mesh = ParallelMesh(list(ranks), tp=parallel.tp, pp=parallel.pp, ep=parallel.ep,
                                cache=cache)
            if not mesh.is_member:
                continue
            got = {}
            for overlap in (True, False):
                engine = _engine(folders[model], mesh, parallel, case, overlap=overlap)
                got[overlap] = {"stats": _steps(engine), "params": exported(engine),
                                "buckets": [len(s.grads.part.buckets) for s in engine._sets]}
            results[name] = got
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    folders = {name: str(make_tiny_model(TinyModelConfig(**{**SMALL, "num_layers": 4}, **kw),
                                         root / name)) for name, kw in MODELS.items()}
    folders["moe"] = str(make_tiny_model(MOE, root / "moe"))
    return run_distributed(_run_all, 4, folders, timeout_s=600)


@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_grad_sums_equal_the_synchronous_ones_bit_for_bit(runs, name):
    for rank in CASES[name][1]:
        got = runs[rank][name]
        overlapped, synchronous = got[True], got[False]
        for a, b in zip(overlapped["stats"], synchronous["stats"]):
            assert a["grad_norm"] == b["grad_norm"] and a["loss"] == b["loss"], rank
            assert all(n > 0 for n in a["overlapped"]), (rank, a["overlapped"])
            assert b["overlapped"] == [0] * len(b["overlapped"])
        assert max(overlapped["buckets"]) > 1
        assert overlapped["params"].keys() == synchronous["params"].keys()
        for key, tensor in overlapped["params"].items():
            assert torch.equal(tensor, synchronous["params"][key]), (rank, key)
