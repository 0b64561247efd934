"""Qwen3-MoE with expert parallelism through the engine in 4 gloo processes against
transformers: ep=2 (dp=4, so experts also sync over an edp group of 2), ep=2 x tp=2 with
sequence parallelism, ep=2 x pp=2. Every dp replica runs the whole batch with 1/dp of the loss
(as verify-model does); log-probs, routes, every grad (routers and experts, gathered over ep)
and the load-balancing loss must equal transformers'. At ep=2 alone the batch is cut into two
micro-batches on even ranks and one plus an empty padding micro-batch on odd ranks: the
padding one still serves the other rank's tokens to its experts. Every rank's local experts are
stacked (`rlhf.models.moe.stack_experts`); at ep=2 x tp=2 they run as grouped GEMMs over the
stacks (CUDA's path, forced here), the other layouts through the CPU's expert loop.

The same launch checkpoints at ep=2: a ZeRO-1 engine (dp=4, so experts shard over edp=2) takes
a step, saves, and a fresh engine loads and takes the second step, which must equal the
uninterrupted engine's bit for bit; the same checkpoint resumed at dp=2 (edp=1: the expert
optimizer reshards) must match it too, and so must the same checkpoint loaded at ep=1 (dp=4:
every rank holds every expert, their optimizer state sharded over dp with the dense one)."""

from pathlib import Path
from unittest import mock

import pytest
import torch

from rlhf.config.schema import OptimizerConfig, ParallelConfig
from rlhf.data.packing import pack_prompt_response
from rlhf.data.routes import ROUTES
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import MicroBatch, TrainEngine, make_micro_batches
from rlhf.models.moe import SparseMoeBlock, _down_weights, _gate_up_weights
from rlhf.models.weight_stacks import stacked_view
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.dist.test_moe_parallel import COEF, SPEC, _reference, _seqs, _weights
from tests.unit.engine.reference import exported, max_param_error

TOL = 1e-5
WORLD = 4
# (tp, pp, sequence_parallel, ep, aux coefficient): pp=2 trains without the aux loss
# (the aux loss pools a micro-batch's tokens: the cut batch of ep=2 alone trains without it)
LAYOUTS = [(1, 1, False, 2, 0.0), (2, 1, True, 2, COEF), (1, 2, False, 2, 0.0)]
GROUPED = (2, 1, True, 2)  # the layout whose experts run as grouped GEMMs


def _stacked(model) -> bool:
    """Whether every MoE layer's local experts are stacked (views for the grouped GEMMs)."""
    return all(stacked_view(_gate_up_weights(experts), 2) is not None
               and stacked_view(_down_weights(experts), 1) is not None
               for experts in (m.local_experts() for m in model.modules()
                               if isinstance(m, SparseMoeBlock)))


def _micro_batches(seqs, *, cut, rank):
    """The whole batch as one micro-batch; with `cut`, two on even ranks (3 + 2 sequences),
    one and an empty padding micro-batch on odd ranks."""
    whole = make_micro_batches([s[:1] for s in seqs], [s[1:] for s in seqs], max_tokens=1000)
    if not cut:
        return whole
    if rank % 2:
        return whole + [MicroBatch(pack_prompt_response([], []), {},
                                   torch.zeros(0, dtype=torch.int64))]
    return [make_micro_batches([s[:1] for s in part], [s[1:] for s in part], max_tokens=1000)[0]
            for part in (seqs[:3], seqs[3:])]


def _run(rank, world, folder, seqs):
    cache = ProcessGroupCache()
    results = {}
    for tp, pp, sp, ep, coef in LAYOUTS:
        mbs = _micro_batches(seqs, cut=(tp, pp) == (1, 1), rank=rank)
        mesh = ParallelMesh(list(range(world)), tp=tp, pp=pp, ep=ep, cache=cache)
        engine = TrainEngine.from_pretrained(
            folder, mesh=mesh, optim=OptimizerConfig(), router_aux_loss_coef=coef,
            parallel=ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp, ep=ep))
        held = {name for name in dict(engine.model.named_parameters()) if ".experts." in name}
        dp = mesh.dp_size
        total = sum(len(s) for s in seqs)
        # where each micro-batch's tokens start in the whole batch (its token counts differ)
        head = sum(len(s) for s in seqs[:3])
        start = {total: 0, head: 0, total - head: head}

        def loss_fn(out, mb, total=total, start=start, dp=dp):
            logp_T = out["log_probs"]
            w_T = _weights(total)[start[len(logp_T)]:][:len(logp_T)]
            return (w_T * logp_T).sum() / dp, {}

        grouped = (tp, pp, sp, ep) == GROUPED
        with mock.patch("rlhf.models.moe.runs_grouped", lambda x, w, on=grouped: on):
            outs = engine.forward(mbs, outputs=("log_probs", ROUTES))
            metrics = engine.forward_backward(mbs, loss_fn)
        out = {k: torch.cat([o[k] for o in outs]) for k in outs[0]} if outs else None
        results[tp, pp, sp, ep] = dict(out=out, metrics=metrics, grads=engine.full_grads(),
                                       held=held, stacked=_stacked(engine.model))
    results["checkpoint"] = _checkpointed(rank, world, folder, seqs, cache)
    return results


def _checkpointed(rank, world, folder, seqs, cache):
    """Step, save at ep=2 (ZeRO-1, dp=4), step again; a fresh engine loads and steps; the same
    checkpoint resumed at dp=2 (edp=1) and at ep=1, each taking the second step."""
    ckpt = str(Path(folder).parent / "ckpt")
    mbs = _micro_batches(seqs, cut=False, rank=rank)

    def engine(mesh):
        return TrainEngine.from_pretrained(folder, mesh=mesh, optim=OptimizerConfig(
            distributed=True), parallel=ParallelConfig(ep=mesh.ep_size), total_steps=4)

    def step(e):
        total = sum(len(s) for s in seqs)
        e.forward_backward(mbs, lambda out, mb: ((_weights(total) * out["log_probs"]).sum()
                                                 / e.mesh.dp_size, {}))
        return e.step()["grad_norm"]

    mesh = ParallelMesh(list(range(world)), ep=2, cache=cache)
    first = engine(mesh)
    step(first)
    first.save_checkpoint(ckpt)
    out = {"grad_norm": step(first), "want": exported(first),
           "expert_shards": first.expert_grads.part.shards}
    resumed = engine(mesh)
    resumed.load_checkpoint(ckpt)
    out.update(resumed_grad_norm=step(resumed), resumed=exported(resumed))
    dp2 = ParallelMesh([0, 1], ep=2, cache=cache)
    if dp2.is_member:
        smaller = engine(dp2)
        smaller.load_checkpoint(ckpt)
        out.update(dp2_grad_norm=step(smaller), dp2=exported(smaller),
                   dp2_expert_shards=smaller.expert_grads.part.shards)
    ep1 = engine(ParallelMesh(list(range(world)), cache=cache))
    ep1.load_checkpoint(ckpt)
    out.update(ep1_grad_norm=step(ep1), ep1=exported(ep1))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(make_tiny_model(SPEC, tmp_path_factory.mktemp("moe_ep") / "m"))
    seqs = _seqs()
    per_rank = run_distributed(_run, WORLD, folder, seqs, timeout_s=240)
    return per_rank, _reference(folder, seqs)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["ep2-padded", "ep2-tp2-sp", "ep2-pp2"])
def test_expert_parallel_layout_matches_transformers(runs, layout):
    per_rank, ref = runs
    tp, pp, sp, ep, coef = layout
    for rank, results in enumerate(per_rank):
        got = results[tp, pp, sp, ep]
        if got["out"] is not None:  # the last pipeline stage, or every rank at pp=1
            assert (got["out"]["log_probs"] - ref["log_probs"]).abs().max() < TOL
            stage_layers = [0, 1] if pp == 1 else [1]
            assert torch.equal(got["out"][ROUTES][:, stage_layers],
                               ref["routes"][:, stage_layers])
        if coef:
            assert abs(got["metrics"]["router_aux_loss"] - ref["aux"]) < TOL
        want = ref[coef]
        assert got["grads"].keys() == want.keys()  # every expert, gathered over ep
        for name, grad in got["grads"].items():
            assert (grad - want[name]).abs().max() < TOL, (layout, rank, name)
        experts = {n.split(".experts.")[1].split(".")[0] for n in got["held"]}
        assert len(experts) == SPEC.num_experts // ep, experts  # each rank holds E / ep
        assert got["stacked"], (layout, rank)
    assert per_rank[-1][tp, pp, sp, ep]["out"] is not None


def test_ep2_checkpoint_resumes_exactly_and_reshards_the_expert_optimizer_over_edp(runs):
    per_rank, _ = runs
    for rank, results in enumerate(per_rank):
        got = results["checkpoint"]
        assert got["expert_shards"] == 2  # ZeRO-1 over edp=2: one file per edp rank
        assert got["resumed_grad_norm"] == got["grad_norm"], rank
        assert got["resumed"].keys() == got["want"].keys()
        for name, tensor in got["want"].items():
            assert torch.equal(got["resumed"][name], tensor), (rank, name)
        if rank < 2:  # resumed at dp=2: edp=1, the saved 2 expert shards resharded into 1
            assert got["dp2_expert_shards"] == 1
            assert got["dp2_grad_norm"] == pytest.approx(got["grad_norm"], rel=1e-5)
            assert max_param_error(got["dp2"], got["want"]) < TOL, rank


def test_an_ep2_checkpoint_loads_at_ep1_and_steps_like_the_ep2_run(runs):
    per_rank, _ = runs
    for rank, results in enumerate(per_rank):
        got = results["checkpoint"]
        assert got["ep1_grad_norm"] == pytest.approx(got["grad_norm"], rel=1e-5), rank
        assert max_param_error(got["ep1"], got["want"]) < TOL, rank
