"""Per-rank parameter shapes from the meta build in a fake world, with and without an
existing torch.distributed world in the process."""

import torch
import torch.distributed as dist

from rlhf.config.schema import ParallelConfig
from rlhf.models.config import ModelArgs
from rlhf.plan.shapes import stage_shapes

ARGS = ModelArgs.from_hf_config(dict(
    model_type="qwen2", vocab_size=387, hidden_size=64, intermediate_size=96,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
PLAN = ParallelConfig(tp=2, pp=2)
# tp 2: heads split (q 4x16 -> 2x16 rows, kv 2x16 -> 1x16), MLP 96 -> 48, vocab 387 -> 388 / 2
WANT = {
    "model.embed_tokens.weight": ((194, 64), 0),
    "model.layers.0.self_attn.q_proj.weight": ((32, 64), 0),
    "model.layers.0.self_attn.q_proj.bias": ((32,), 0),
    "model.layers.0.self_attn.k_proj.weight": ((16, 64), 0),
    "model.layers.0.self_attn.o_proj.weight": ((64, 32), 0),
    "model.layers.0.mlp.down_proj.weight": ((64, 48), 0),
    "model.layers.2.mlp.gate_proj.weight": ((48, 64), 1),
    "model.norm.weight": ((64,), 1),
    "lm_head.weight": ((194, 64), 1),
}


def _check(stages):
    assert len(stages) == 2
    found = {p.name: (p.shape, pp_rank) for pp_rank, shapes in enumerate(stages) for p in shapes}
    for name, want in WANT.items():
        assert found[name] == want, name
    assert "lm_head.weight" not in {p.name for p in stages[0]}  # the head lives on stage 1
    assert all(p.dtype == torch.bfloat16 and p.trainable for s in stages for p in s)


def test_shapes_follow_the_tp_plan_and_the_stage_cut():
    stage_shapes.cache_clear()
    _check(stage_shapes(ARGS, PLAN, head="lm", dtype=torch.bfloat16))
    assert not dist.is_initialized()  # the fake world is gone again


def test_inside_an_existing_world_the_build_runs_in_a_subprocess(single_process_world):
    stage_shapes.cache_clear()
    _check(stage_shapes(ARGS, PLAN, head="lm", dtype=torch.bfloat16))
    assert dist.is_initialized() and dist.get_world_size() == 1  # the caller's world, intact
