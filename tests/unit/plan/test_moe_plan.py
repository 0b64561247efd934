"""The planner on an MoE model: expert and router parameters per rank from the meta build, and
the activation estimate of a sparse block against what autograd actually saves."""

import dataclasses

import pytest
import torch

from rlhf.config.schema import OffloadConfig, ParallelConfig
from rlhf.models.config import ModelArgs
from rlhf.models.moe import Routing, SparseMoeBlock
from rlhf.plan.inputs import RoleSpec
from rlhf.plan.memory import layer_activation_bytes
from rlhf.plan.shapes import stage_shapes

ARGS = ModelArgs.from_hf_config(dict(
    model_type="qwen3_moe", vocab_size=384, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True))


def _spec(args, parallel=ParallelConfig(), tokens=512):
    return RoleSpec(name="actor", head="lm", args=args, parallel=parallel, world_size=parallel.tp,
                    colocated=True, dtype=torch.float32, trains=True, recompute="none",
                    tokens=tokens, shards=1, offload=OffloadConfig())


def test_expert_and_router_parameters_per_rank():
    stage_shapes.cache_clear()
    (full,) = stage_shapes(ARGS, ParallelConfig(), head="lm", dtype=torch.float32)
    (half,) = stage_shapes(ARGS, ParallelConfig(tp=2), head="lm", dtype=torch.float32)
    full_n, half_n = ({p.name: p.shape for p in s} for s in (full, half))
    experts = [n for n in full_n if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3 and "model.layers.0.mlp.gate_proj.weight" not in full_n
    assert half_n["model.layers.1.mlp.experts.7.gate_proj.weight"] == (24, 64)  # column split
    assert half_n["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 24)  # row split
    assert half_n["model.layers.0.mlp.gate.weight"] == full_n["model.layers.0.mlp.gate.weight"] \
        == (8, 64)  # the router is replicated
    per_layer = 8 * 3 * 64 * 48 + 8 * 64
    assert sum(p.numel for p in full if ".mlp." in p.name) == 2 * per_layer


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
@pytest.mark.parametrize("top_k,experts", [(2, 8), (3, 4)])
def test_sparse_block_activation_estimate_is_what_autograd_saves(top_k, experts, grouped,
                                                                  monkeypatch):
    # grouped: CUDA's grouped GEMMs (forced here), whose stacked weights must not be saved
    monkeypatch.setattr("rlhf.models.moe.runs_grouped", lambda x, w: grouped)
    args = dataclasses.replace(ARGS, num_experts=experts, num_experts_per_tok=top_k)
    tokens = 512
    block = SparseMoeBlock(args, layer=0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(0))
    x_TH = torch.randn(tokens, args.hidden_size, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x_TH, Routing(num_tokens=tokens))
    measured = sum(saved.values()) / tokens
    # The block's share: the all-MoE layer less the same layer with a width-1 dense MLP, whose
    # share (its input and 4 one-wide SwiGLU tensors, fp32) is known.
    dense = dataclasses.replace(args, num_experts=0, intermediate_size=1)
    estimate = (layer_activation_bytes(_spec(args), "none")
                - layer_activation_bytes(_spec(dense), "none") + 4 * (args.hidden_size + 4))
    assert estimate == pytest.approx(measured, rel=0.03)
