"""The engine pairs each dense MLP's gate and up weights (rlhf.models.gate_up) and keeps them
paired through optimizer steps, offload round trips and a checkpoint load; training with the
pairing computes what training without it computes."""

import dataclasses

import pytest

import rlhf.engine.engine as engine_module
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.models.gate_up import paired_weight
from rlhf.models.transformer import MLP
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


def _engine(folder, optim=OPTIM):
    mesh = ParallelMesh([0], cache=ProcessGroupCache())
    return TrainEngine.from_pretrained(folder, mesh=mesh, head="lm", optim=optim, total_steps=10,
                                       device="cpu", dtype="float32")


def _paired(engine):
    mlps = [m for m in engine.model.modules() if isinstance(m, MLP)]
    assert len(mlps) == SMALL["num_layers"]
    return [paired_weight(m.gate_proj.weight, m.up_proj.weight) is not None for m in mlps]


def _train_step(engine, seed):
    batch = make_batch(seed)
    mbs = make_micro_batches(batch.prompts, batch.responses, batch.per_token, max_tokens=24)
    tokens, _ = engine.loss_normalizers(mbs, mask_key="loss_mask")
    return {**engine.forward_backward(mbs, actor_loss_fn(tokens)), **engine.step()}


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "zero1"])
def test_steps_keep_the_pairing_and_match_the_two_linears(folder, world, monkeypatch,
                                                          distributed):
    optim = dataclasses.replace(OPTIM, distributed=distributed)
    paired = _engine(folder, optim)
    assert all(_paired(paired))
    start = exported(paired)
    monkeypatch.setattr(engine_module, "pair_gate_up", lambda model: 0)
    separate = _engine(folder, optim)
    assert not any(_paired(separate))
    for seed in (0, 1):
        got, want = _train_step(paired, seed), _train_step(separate, seed)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert all(_paired(paired))  # updated in place
    assert_same_export(paired, separate, start=start,
                       moved="model.layers.0.mlp.gate_proj.weight")


def test_offload_and_a_checkpoint_load_keep_the_pairing(folder, world, tmp_path):
    assert_kept_through_offload_and_checkpoint(
        _engine(folder), lambda: _engine(folder), _paired,
        lambda engine: _train_step(engine, 0), tmp_path)
