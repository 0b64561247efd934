"""Qwen3-MoE through the engine in gloo processes against transformers: expert TP (tp=2, with
and without sequence parallelism) and pp=2; logits, log-probs, routes, grads (routers
included) and the load-balancing loss, which the engine adds to the loss."""

import pytest
import torch

from rlhf.config.schema import OptimizerConfig, ParallelConfig, TinyModelConfig
from rlhf.data.packing import pack, shifted_targets
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.data.routes import ROUTES
from rlhf.models.moe import split_fused_experts
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache

TOL = 1e-5
COEF = 0.5  # large, so the aux loss's share of the router grads is well above TOL
SPEC = TinyModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=64, num_heads=2,
                       num_kv_heads=2, intermediate_size=96, vocab_size=384,
                       max_position_embeddings=64, num_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=32, seed=3)
LENGTHS = [1, 13, 7, 22, 4]  # 47 tokens: not a multiple of tp, so SP pads
# (tp, pp, sequence_parallel, aux coefficient): the aux loss pools all layers, so pp=2 runs 0.
LAYOUTS = [(2, 1, True, COEF), (2, 1, False, COEF), (1, 2, False, 0.0)]


def _seqs():
    gen = torch.Generator().manual_seed(0)
    # ids from 3 up: HF's embedding gives the pad row (id 2 or lower) no gradient
    return [torch.randint(3, SPEC.vocab_size, (n,), generator=gen) for n in LENGTHS]


def _weights(n):
    return torch.randn(n, generator=torch.Generator().manual_seed(1))


def _reference(folder, seqs):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    packed = pack(seqs)
    outs = [hf(s[None], output_router_logits=True) for s in seqs]
    router = [torch.cat(layer) for layer in zip(*[o.router_logits for o in outs])]
    aux = load_balancing_loss_func(tuple(router), SPEC.num_experts, SPEC.num_experts_per_tok)
    logits_TV = torch.cat([o.logits[0] for o in outs])
    targets_T, valid_T = shifted_targets(packed)
    logp_T = torch.log_softmax(logits_TV, -1).gather(-1, targets_T[:, None])[:, 0] * valid_T
    ref = dict(log_probs=logp_T.detach(), aux=float(aux.detach()),
               routes=torch.stack([r.topk(SPEC.num_experts_per_tok).indices for r in router], 1))
    for coef in (0.0, COEF):
        hf.zero_grad()
        logits_TV = torch.cat([hf(s[None]).logits[0] for s in seqs])
        logp_T = torch.log_softmax(logits_TV, -1).gather(-1, targets_T[:, None])[:, 0]
        loss = (_weights(len(logp_T)) * logp_T * valid_T).sum()
        if coef:
            outs = [hf(s[None], output_router_logits=True) for s in seqs]
            router = tuple(torch.cat(layer) for layer in zip(*[o.router_logits for o in outs]))
            loss = loss + coef * load_balancing_loss_func(router, SPEC.num_experts,
                                                          SPEC.num_experts_per_tok)
        loss.backward()
        ref[coef] = split_fused_experts({n: p.grad.clone() for n, p in hf.named_parameters()})
    return ref


def _loss_fn(out, mb):
    logp_T = out["log_probs"]
    return (_weights(len(logp_T)) * logp_T).sum(), {}


def _run(rank, world, folder, seqs):
    cache = ProcessGroupCache()
    results = {}
    mbs = make_micro_batches([s[:1] for s in seqs], [s[1:] for s in seqs], max_tokens=1000)
    for tp, pp, sp, coef in LAYOUTS:
        mesh = ParallelMesh(list(range(world)), tp=tp, pp=pp, cache=cache)
        engine = TrainEngine.from_pretrained(
            folder, mesh=mesh, parallel=ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp),
            optim=OptimizerConfig(), router_aux_loss_coef=coef)
        outs = engine.forward(mbs, outputs=("log_probs", ROUTES))
        metrics = engine.forward_backward(mbs, _loss_fn)
        grads = engine.full_grads()
        results[tp, pp, sp] = dict(out=outs[0] if outs else None, metrics=metrics, grads=grads)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(make_tiny_model(SPEC, tmp_path_factory.mktemp("moe") / "m"))
    seqs = _seqs()
    per_rank = run_distributed(_run, 2, folder, seqs, timeout_s=150)
    return per_rank, _reference(folder, seqs)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2-sp", "tp2", "pp2"])
def test_moe_layout_matches_transformers(runs, layout):
    per_rank, ref = runs
    tp, pp, sp, coef = layout
    for rank, results in enumerate(per_rank):
        got = results[tp, pp, sp]
        if got["out"] is not None:  # the last pipeline stage, or every TP rank
            assert (got["out"]["log_probs"] - ref["log_probs"]).abs().max() < TOL
            routes = got["out"][ROUTES]
            stage_layers = [0, 1] if pp == 1 else [1]
            assert torch.equal(routes[:, stage_layers], ref["routes"][:, stage_layers])
        if coef:
            assert abs(got["metrics"]["router_aux_loss"] - ref["aux"]) < TOL
        want = ref[coef]
        assert got["grads"].keys() == want.keys()
        for name, grad in got["grads"].items():
            assert (grad - want[name]).abs().max() < TOL, (layout, rank, name)
        routers = [n for n in want if n.endswith("mlp.gate.weight")]
        assert routers and all(want[n].abs().max() > 1e-3 for n in routers)
    assert per_rank[-1][tp, pp, sp]["out"] is not None
