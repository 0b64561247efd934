"""The engine stacks each MoE layer's expert weights (rlhf.models.moe.stack_experts) and keeps
them stacked through optimizer steps (ZeRO-1 on and off), offload round trips and a checkpoint
load; training on the stacks through the grouped GEMMs computes what the expert loop computes
on unstacked weights (loss, grads, parameters after the step)."""

import dataclasses

import pytest
import torch

import rlhf.engine.engine as engine_module
from rlhf.config.schema import TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.models.moe import SparseMoeBlock, _down_weights, _gate_up_weights
from rlhf.models.weight_stacks import stacked_view
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import (
    OPTIM,
    SMALL,
    actor_loss_fn,
    assert_kept_through_offload_and_checkpoint,
    assert_same_export,
    exported,
    make_batch,
)

MOE = TinyModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=64, num_heads=2,
                      num_kv_heads=1, intermediate_size=96, vocab_size=SMALL["vocab_size"],
                      max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return make_tiny_model(MOE, tmp_path_factory.mktemp("moe") / "qwen3_moe")


def _engine(folder, optim=OPTIM):
    mesh = ParallelMesh([0], cache=ProcessGroupCache())
    return TrainEngine.from_pretrained(folder, mesh=mesh, head="lm", optim=optim, total_steps=10,
                                       device="cpu", dtype="float32")


def _stacked(engine):
    blocks = [m for m in engine.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == MOE.num_layers
    return [stacked_view(_gate_up_weights(experts), 2) is not None
            and stacked_view(_down_weights(experts), 1) is not None
            for experts in (b.local_experts() for b in blocks)]


def _train_step(engine, seed):
    batch = make_batch(seed)
    mbs = make_micro_batches(batch.prompts, batch.responses, batch.per_token, max_tokens=24)
    tokens, _ = engine.loss_normalizers(mbs, mask_key="loss_mask")
    out = engine.forward_backward(mbs, actor_loss_fn(tokens))
    grads = {name: g.clone() for name, g in engine.full_grads().items()}
    return {**out, **engine.step()}, grads


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "zero1"])
def test_steps_on_the_stacks_match_the_loop_on_unstacked_experts(moe_folder, world,
                                                                 monkeypatch, distributed):
    optim = dataclasses.replace(OPTIM, distributed=distributed)
    stacked = _engine(moe_folder, optim)
    assert all(_stacked(stacked))
    start = exported(stacked)
    with monkeypatch.context() as m:
        m.setattr(engine_module, "stack_experts", lambda model: 0)
        separate = _engine(moe_folder, optim)
    assert not any(_stacked(separate))
    for seed in (0, 1):
        # the stacked engine through the grouped GEMMs (CUDA's path, forced here), the other
        # through the expert-by-expert loop (the CPU's)
        monkeypatch.setattr("rlhf.models.moe.runs_grouped", lambda x, w: True)
        got, got_grads = _train_step(stacked, seed)
        monkeypatch.setattr("rlhf.models.moe.runs_grouped", lambda x, w: False)
        want, want_grads = _train_step(separate, seed)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert got_grads.keys() == want_grads.keys()
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-6,
                                       msg=name)
    assert all(_stacked(stacked))  # updated in place
    assert_same_export(stacked, separate, start=start,
                       moved="model.layers.0.mlp.experts.1.up_proj.weight")


def test_offload_and_a_checkpoint_load_keep_the_stacks(moe_folder, world, tmp_path):
    assert_kept_through_offload_and_checkpoint(
        _engine(moe_folder), lambda: _engine(moe_folder), _stacked,
        lambda engine: _train_step(engine, 0), tmp_path)
