"""Qwen3-MoE with expert parallelism through the engine in 4 gloo processes against
transformers: ep=2 (dp=4, so experts also sync over an edp group of 2), ep=2 x tp=2 with
sequence parallelism, ep=2 x pp=2. Every dp replica runs the whole batch with 1/dp of the loss
(as verify-model does); log-probs, routes, every grad (routers and experts, gathered over ep)
and the load-balancing loss must equal transformers'. At ep=2 alone the batch is cut into two
micro-batches on even ranks and one plus an empty padding micro-batch on odd ranks: the
padding one still serves the other rank's tokens to its experts."""

import pytest
import torch

from rlhf.config.schema import OptimizerConfig, ParallelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.data.packing import pack_prompt_response
from rlhf.engine import MicroBatch, TrainEngine, make_micro_batches
from rlhf.models.moe import ROUTES_KEY
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.dist.test_moe_parallel import COEF, SPEC, _reference, _seqs, _weights

TOL = 1e-5
WORLD = 4
# (tp, pp, sequence_parallel, ep, aux coefficient): pp=2 trains without the aux loss
# (the aux loss pools a micro-batch's tokens: the cut batch of ep=2 alone trains without it)
LAYOUTS = [(1, 1, False, 2, 0.0), (2, 1, True, 2, COEF), (1, 2, False, 2, 0.0)]


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
        outs = engine.forward(mbs, outputs=("log_probs", ROUTES_KEY))
        dp = mesh.dp_size

        total = sum(len(s) for s in seqs)
        # where each micro-batch's tokens start in the whole batch (its token counts differ)
        head = sum(len(s) for s in seqs[:3])
        start = {total: 0, head: 0, total - head: head}

        def loss_fn(out, mb):
            logp_T = out["log_probs"]
            w_T = _weights(total)[start[len(logp_T)]:][:len(logp_T)]
            return (w_T * logp_T).sum() / dp, {}

        metrics = engine.forward_backward(mbs, loss_fn)
        out = {k: torch.cat([o[k] for o in outs]) for k in outs[0]} if outs else None
        results[tp, pp, sp, ep] = dict(out=out, metrics=metrics, grads=engine.full_grads(),
                                       held=held)
    return results


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
            assert torch.equal(got["out"][ROUTES_KEY][:, stage_layers],
                               ref["routes"][:, stage_layers])
        if coef:
            assert abs(got["metrics"]["router_aux_loss"] - ref["aux"]) < TOL
        want = ref[coef]
        assert got["grads"].keys() == want.keys()  # every expert, gathered over ep
        for name, grad in got["grads"].items():
            assert (grad - want[name]).abs().max() < TOL, (layout, rank, name)
        experts = {n.split(".experts.")[1].split(".")[0] for n in got["held"]}
        assert len(experts) == SPEC.num_experts // ep, experts  # each rank holds E / ep
    assert per_rank[-1][tp, pp, sp, ep]["out"] is not None
