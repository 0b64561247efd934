"""The Qwen3-MoE block against transformers (logits, log-probs, grads with the router's, the
load-balancing loss) and the routing hook (forced routes, recorded routes)."""

import dataclasses

import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf.config.schema import TinyModelConfig
from rlhf.data.packing import pack, shifted_targets
from rlhf.demo.tiny_model import _init_weights, tiny_hf_config
from rlhf.models.config import ModelArgs
from rlhf.models.hf_io import load_hf_weights
from rlhf.models.moe import Routing, SparseMoeBlock, split_fused_experts
from rlhf.models.transformer import MLP, CausalLM

TOL = 1e-5
AUX_COEF = 0.5  # large, so the aux loss's share of the router grads is well above TOL
# Three layers, the middle one dense (mlp_only_layers): both kinds of layer and the choice rule.
SPEC = TinyModelConfig(arch="qwen3_moe", num_layers=3, hidden_size=64, num_heads=2,
                       num_kv_heads=1, intermediate_size=96, vocab_size=384,
                       max_position_embeddings=64, num_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("moe")
    config = tiny_hf_config(SPEC, bos_id=0, eos_id=1, pad_id=2)
    config.mlp_only_layers = [1]
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(hf, seed=0)
    save_file(split_fused_experts({k: v.contiguous() for k, v in hf.state_dict().items()}),
              path / "model.safetensors", metadata={"format": "pt"})
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(folder):
    from transformers import AutoModelForCausalLM

    ours = CausalLM(ModelArgs.from_pretrained(folder))
    load_hf_weights(ours, folder)
    return ours, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def packed():
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, SPEC.vocab_size, (n,), generator=gen) for n in (1, 13, 7, 20)]
    return seqs, pack(seqs)


def _forward(model, p, routing=None):
    return model(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen, routing=routing)


def _hf_forward(hf, seqs):
    """Logits and transformers' aux loss of the packed stream, one sequence at a time."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    outs = [hf(s[None], output_router_logits=True) for s in seqs]
    router = tuple(torch.cat(layer) for layer in zip(*[o.router_logits for o in outs]))
    aux = load_balancing_loss_func(router, SPEC.num_experts, SPEC.num_experts_per_tok)
    return torch.cat([o.logits[0] for o in outs]), aux


def _loss(logits_TV, aux, p):
    targets_T, valid_T = shifted_targets(p)
    weights_T = torch.randn(p.tokens.numel(), generator=torch.Generator().manual_seed(1))
    logp_T = torch.log_softmax(logits_TV, -1).gather(-1, targets_T[:, None])[:, 0]
    return (weights_T * logp_T * valid_T).sum() + AUX_COEF * aux


def test_layers_and_names_follow_the_checkpoint(models):
    ours, hf = models
    kinds = [type(ours.model.layers[str(i)].mlp) for i in range(SPEC.num_layers)]
    assert kinds == [SparseMoeBlock, MLP, SparseMoeBlock]
    hf_names = split_fused_experts(dict(hf.named_parameters())).keys()
    assert {n for n, _ in ours.named_parameters()} == set(hf_names)


def test_logits_grads_and_aux_loss_match_transformers(models, packed):
    seqs, p = packed
    ours, hf = models
    ours.zero_grad(), hf.zero_grad()
    routing = Routing(num_tokens=p.tokens.numel())
    logits_TV = _forward(ours, p, routing)
    ref_TV, ref_aux = _hf_forward(hf, seqs)
    assert (logits_TV - ref_TV).abs().max() < TOL
    aux = routing.aux_loss()
    assert abs(float((aux - ref_aux).detach())) < TOL and float(aux.detach()) > 1.0  # E * sum f P >= 1
    _loss(logits_TV, aux, p).backward()
    _loss(ref_TV, ref_aux, p).backward()
    hf_grads = split_fused_experts({n: q.grad for n, q in hf.named_parameters()})
    for name, param in ours.named_parameters():
        if param.grad is None:  # an expert no token was routed to
            assert hf_grads[name] is None or hf_grads[name].abs().max() == 0, name
            continue
        assert (param.grad - hf_grads[name]).abs().max() < TOL, name
    router = ours.model.layers["0"].mlp.gate.weight.grad
    assert router.abs().max() > 1e-3


def test_aux_loss_reaches_the_router(models, packed):
    """Only the aux loss, no logits: the router still gets exactly transformers' gradient."""
    seqs, p = packed
    ours, hf = models
    ours.zero_grad(), hf.zero_grad()
    routing = Routing(num_tokens=p.tokens.numel())
    _forward(ours, p, routing)
    routing.aux_loss().backward()
    _hf_forward(hf, seqs)[1].backward()
    for layer in ("0", "2"):
        ref = hf.model.layers[int(layer)].mlp.gate.weight.grad
        got = ours.model.layers[layer].mlp.gate.weight.grad
        assert ref.abs().max() > 1e-4 and (got - ref).abs().max() < 1e-7


@pytest.mark.parametrize("field,value", [("norm_topk_prob", False), ("num_experts_per_tok", 3),
                                         ("mlp_only_layers", ())])
def test_a_wrong_routing_rule_is_caught(folder, models, packed, field, value):
    """The comparison above is sharp: one changed routing rule moves the logits far past TOL."""
    seqs, p = packed
    args = dataclasses.replace(ModelArgs.from_pretrained(folder), **{field: value})
    wrong = CausalLM(args)
    load_hf_weights(wrong, folder) if field != "mlp_only_layers" else None
    if field == "mlp_only_layers":  # layer 1 now has experts the checkpoint lacks: copy the rest
        wrong.load_state_dict(models[0].state_dict(), strict=False)
    with torch.no_grad():
        assert (_forward(wrong, p) - _hf_forward(models[1], seqs)[0]).abs().max() > 100 * TOL


def test_forced_routes_replay_and_override(models, packed):
    _, p = packed
    ours, _ = models
    T, K = p.tokens.numel(), SPEC.num_experts_per_tok
    recorded = Routing(num_tokens=T, record=True)
    with torch.no_grad():
        free_TV = _forward(ours, p, recorded)
    routes = recorded.routes_tensor(SPEC.num_layers, K)
    assert routes.shape == (T, SPEC.num_layers, K)
    assert (routes[:, 1] == -1).all() and (routes[:, 0] >= 0).all()  # layer 1 is dense
    # Replaying the recorded routes gives the same model.
    with torch.no_grad():
        assert torch.equal(_forward(ours, p, Routing(num_tokens=T, forced=routes)), free_TV)
    # Forcing other experts: every forced token uses them, free (-1) tokens route themselves.
    forced = (routes + 1) % SPEC.num_experts
    forced[:, 1] = -1
    forced[:3, 2] = -1
    replay = Routing(num_tokens=T, forced=forced, record=True)
    ours.zero_grad()
    out_TV = _forward(ours, p, replay)
    assert (out_TV - free_TV).abs().max() > 100 * TOL
    assert torch.equal(replay.routes[0], forced[:, 0])
    assert torch.equal(replay.routes[2][3:], forced[3:, 2])
    assert torch.equal(replay.routes[2][:3], routes[:3, 2])
    out_TV.square().mean().backward()
    assert ours.model.layers["0"].mlp.gate.weight.grad.abs().max() > 0  # router still learns


def test_forced_weights_are_the_router_probabilities_at_the_forced_experts(models):
    """One block by hand: out = sum_k p[f_k] / sum_k p[f_k] * expert_{f_k}(x)."""
    block = models[0].model.layers["0"].mlp
    gen = torch.Generator().manual_seed(2)
    x_TH = torch.randn(5, SPEC.hidden_size, generator=gen)
    forced = torch.stack([torch.randperm(SPEC.num_experts, generator=gen)[:2] for _ in range(5)])
    with torch.no_grad():
        out = block(x_TH, Routing(num_tokens=5, forced=forced[:, None].expand(5, 1, 2)))
        probs = torch.softmax(x_TH @ block.gate.weight.T, -1)
        for t in range(5):
            w = probs[t, forced[t]] / probs[t, forced[t]].sum()
            ref = sum(w[k] * block.experts[str(int(forced[t, k]))](x_TH[t]) for k in range(2))
            assert (out[t] - ref).abs().max() < 1e-6


def test_bad_forced_routes_are_refused(models):
    block = models[0].model.layers["0"].mlp
    x_TH = torch.randn(4, SPEC.hidden_size)
    with pytest.raises(ValueError, match="top_k=2"):
        block(x_TH, Routing(num_tokens=4, forced=torch.zeros(4, 1, 3, dtype=torch.int64)))
    with pytest.raises(ValueError, match="outside"):
        block(x_TH, Routing(num_tokens=4, forced=torch.full((4, 1, 2), 99)))


def test_config_reads_the_saved_expert_count():
    base = dict(model_type="qwen3_moe", vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=4, num_attention_heads=2)
    args = ModelArgs.from_hf_config({**base, "num_local_experts": 4, "num_experts_per_tok": 2,
                                     "decoder_sparse_step": 2})
    assert (args.num_experts, args.num_experts_per_tok, args.head_dim) == (4, 2, 4)
    assert [args.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert args.qk_norm and args.router_aux_loss_coef == 0.001 and not args.norm_topk_prob
    dense = ModelArgs.from_hf_config({**base, "model_type": "qwen3", "head_dim": 4})
    assert not dense.is_moe and dense.num_experts == 0


def test_full_recompute_gives_the_same_grads(folder, packed):
    """A recomputed layer re-runs its routing in backward: same routes, same stats, same grads."""
    from rlhf.engine.recompute import apply_recompute

    _, p = packed
    grads = []
    for mode in ("none", "full"):
        model = CausalLM(ModelArgs.from_pretrained(folder))
        load_hf_weights(model, folder)
        apply_recompute(model, mode)
        routing = Routing(num_tokens=p.tokens.numel())
        logits_TV = _forward(model, p, routing)
        _loss(logits_TV, routing.aux_loss(), p).backward()
        grads.append({n.replace(".inner.", "."): q.grad for n, q in model.named_parameters()
                      if q.grad is not None})  # the wrapper adds "inner."
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-7), name


class _HostReads(TorchDispatchMode):
    """Counts tensor -> Python scalar reads (`.item()`, `.tolist()` on the CPU dispatch to
    `_local_scalar_dense` per element, or are counted by the patched `Tensor.tolist`)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        real = torch.Tensor.tolist

        def tolist(tensor):
            self.count += 1
            return real(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_experts_run_as_grouped_gemms_without_a_host_read(models, monkeypatch):
    """One block: grouped GEMMs (gate and up merged; CUDA's path, forced here) equal the
    expert-by-expert loop, forward and grads, an unrouted expert included, and read nothing
    back to the host."""
    block = models[0].model.layers["0"].mlp
    monkeypatch.setattr("rlhf.models.moe.runs_grouped", lambda x, w: True)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    gen = torch.Generator().manual_seed(4)
    x_TH = torch.randn(2, SPEC.hidden_size, generator=gen)  # 4 routes: 2+ of 6 experts idle
    weights = [p for e in block.experts.values() for p in e.parameters()]

    def run(x):
        block.zero_grad()  # earlier tests leave grads on the shared model
        out = block(x, Routing(num_tokens=2))
        out.square().sum().backward()
        grads = [p.grad.clone() for p in weights]
        return out.detach(), grads

    with _HostReads(monkeypatch) as reads:
        grouped, grouped_grads = run(x_TH)
    # forward: gate+up, then down; backward: down's input and weight grads, gate+up's weight
    # grads (the block's input needs none here), no expert-by-expert loop either way
    assert reads.count == 0 and len(calls) == 5
    with monkeypatch.context() as m:
        m.setattr("rlhf.models.moe.runs_grouped", lambda x, w: False)
        looped, looped_grads = run(x_TH)
    assert len(calls) == 5  # the loop ran
    torch.testing.assert_close(grouped, looped, rtol=0, atol=1e-6)
    for got, want in zip(grouped_grads, looped_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    idle = [g.abs().max() == 0 for g in grouped_grads]
    assert 2 * 3 <= sum(idle) < len(idle)  # the unrouted experts' grads are zeros


def _experts_against_the_loop(experts, x_NH, counts_E, *, frozen: bool, monkeypatch,
                              fused: bool = False):
    """(grouped GEMM calls, output, input grad, weight grads) of grouped_experts and of the
    expert-by-expert loop, the grads of a random projection of the output."""
    from rlhf.models.moe import grouped_experts

    weights = [p for e in experts for p in e.parameters()]
    for w in weights:
        w.requires_grad_(not frozen)
    monkeypatch.setattr("rlhf.models.moe.runs_grouped", lambda x, w: True)  # CPU runs the loop
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    probe = torch.randn(x_NH.shape, generator=torch.Generator().manual_seed(1)).to(x_NH)
    results = []
    for run in (lambda x: grouped_experts(experts, x, counts_E, fused=fused),
                lambda x: torch.cat([e(r) for e, r in zip(experts, x.split(counts_E.tolist()))])):
        x = x_NH.detach().clone().requires_grad_()
        out = run(x)
        (out * probe).sum().backward()
        results.append((out.detach(), x.grad, [None if frozen else w.grad.clone()
                                                for w in weights]))
        for w in weights:
            w.grad = None
    return len(calls), results[0], results[1]


@pytest.mark.parametrize("frozen, fused", [(False, False), (True, False), (False, True)],
                         ids=["trained", "frozen", "trained-compiled"])
def test_grouped_experts_backward_equals_the_loop(frozen, fused, monkeypatch):
    """Input and weight grads through the grouped GEMMs' own backward equal the loop's; frozen
    experts (a LoRA run) skip the weight-grad GEMMs; the SwiGLU between them compiled too."""
    from rlhf.models.moe import Expert

    torch.manual_seed(0)
    experts = [Expert(64, 32) for _ in range(5)]
    counts = torch.tensor([4, 0, 7, 1, 3])  # an unrouted expert among them
    x = torch.randn(int(counts.sum()), 64)
    calls, grouped, looped = _experts_against_the_loop(experts, x, counts, frozen=frozen,
                                                       monkeypatch=monkeypatch, fused=fused)
    # forward: gate+up, down; backward: both input grads, and both weight grads unless frozen
    assert calls == (4 if frozen else 6)
    for got, want in zip(grouped[:2], looped[:2]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for got, want in zip(grouped[2], looped[2]):
        if frozen:
            assert got is None and want is None
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused, stacked", [(False, False), (True, False), (False, True)],
                         ids=["eager", "compiled", "stored-stacks"])
def test_cuda_grouped_gemm_experts_match_the_loop_in_bf16(monkeypatch, fused, stacked):
    """The CUDA grouped GEMM's operand layouts, forward and both backward GEMMs, in bf16;
    with SwiGLU between them eager and compiled (`compile: auto` on CUDA); over weights
    stacked per pass and stored stacked (views, as the engine leaves them)."""
    from rlhf.models.moe import Expert, stack_expert_weights

    torch.manual_seed(0)
    experts = [Expert(64, 32).cuda().bfloat16() for _ in range(6)]
    if stacked:
        assert stack_expert_weights(experts)
    counts = torch.tensor([5, 0, 9, 3, 1, 6], device="cuda")
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=torch.bfloat16)
    calls, grouped, looped = _experts_against_the_loop(experts, x, counts, frozen=False,
                                                       monkeypatch=monkeypatch, fused=fused)
    assert calls == 6
    for got, want in zip([*grouped[:2], *grouped[2]], [*looped[:2], *looped[2]]):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


class _Ops(TorchDispatchMode):
    """The aten ops run under it, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_stacked_experts_run_on_views_and_equal_the_loop(monkeypatch):
    """Experts whose weights are blocks of two stacks (`stack_expert_weights`, as the engine
    leaves them) run the grouped GEMMs on views of the stacks, forward and backward, with the
    loop's numbers; a weight moved out of its stack makes them stack a copy, same numbers."""
    from rlhf.models.moe import (
        Expert,
        _down_weights,
        _gate_up_weights,
        grouped_experts,
        stack_expert_weights,
    )
    from rlhf.models.weight_stacks import stacked_view

    torch.manual_seed(0)
    experts = [Expert(64, 32) for _ in range(4)]
    before = [p.detach().clone() for e in experts for p in e.parameters()]
    assert stacked_view(_gate_up_weights(experts), 2) is None
    assert stack_expert_weights(experts)
    assert all(torch.equal(p, b) for p, b in zip((p for e in experts for p in e.parameters()),
                                                 before))  # values kept
    gate_up = stacked_view(_gate_up_weights(experts), 2)
    down = stacked_view(_down_weights(experts), 1)
    assert gate_up is not None and down is not None
    assert gate_up.shape == (4, 64, 64) and down.shape == (4, 64, 32)
    assert torch.equal(gate_up[2, :32], experts[2].gate_proj.weight)
    assert torch.equal(gate_up[2, 32:], experts[2].up_proj.weight)
    assert torch.equal(down[3], experts[3].down_proj.weight)
    assert stack_expert_weights(experts)  # already stacked: nothing moves
    again = stacked_view(_gate_up_weights(experts), 2)
    assert again is not None and again.data_ptr() == gate_up.data_ptr()

    counts = torch.tensor([3, 0, 6, 2])
    x = torch.randn(int(counts.sum()), 64)
    with _Ops() as ops:  # the grouped path, forward and backward, on the stored stacks
        monkeypatch.setattr("rlhf.models.moe.runs_grouped", lambda x, w: True)
        grouped_experts(experts, x.requires_grad_(), counts).square().sum().backward()
    assert ops.names.count("_grouped_mm.default") == 6
    assert "stack.default" not in ops.names  # no copy of the stacks (the copy stacks)
    for e in experts:
        e.zero_grad(set_to_none=True)
    _, stacked, looped = _experts_against_the_loop(experts, x, counts, frozen=False,
                                                   monkeypatch=monkeypatch)
    for got, want in zip([*stacked[:2], *stacked[2]], [*looped[:2], *looped[2]]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    with torch.no_grad():  # one weight moved out: the stack is broken, the path copies
        experts[1].up_proj.weight.data = experts[1].up_proj.weight.clone()
    assert stacked_view(_gate_up_weights(experts), 2) is None
    assert stacked_view(_down_weights(experts), 1) is not None
    with _Ops() as ops:
        grouped_experts(experts, x, counts)
    assert "stack.default" in ops.names
    _, copied, _ = _experts_against_the_loop(experts, x, counts, frozen=False,
                                             monkeypatch=monkeypatch)
    for got, want in zip([*copied[:2], *copied[2]], [*stacked[:2], *stacked[2]]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
