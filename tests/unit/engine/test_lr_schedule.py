"""lr_at against learning rates computed by hand."""

import math

import pytest

from rlhf.config.schema import OptimizerConfig
from rlhf.engine.optim import decays, lr_at


def _cfg(**kw):
    return OptimizerConfig(lr=1.0, **kw)


def test_warmup_is_linear_and_reaches_peak_on_its_last_step():
    cfg = _cfg(warmup_steps=4)
    assert [lr_at(s, cfg, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_constant_stays_at_peak_past_total_steps():
    cfg = _cfg(schedule="constant", min_lr_ratio=0.5)
    assert lr_at(0, cfg, 10) == 1.0 and lr_at(50, cfg, 10) == 1.0


def test_linear_decay_after_warmup_to_min_lr_at_total_steps():
    # warmup 4, total 14: decay spans steps 4..14 (10 steps) from 1.0 to 0.1
    cfg = _cfg(warmup_steps=4, schedule="linear", min_lr_ratio=0.1)
    assert lr_at(3, cfg, 14) == 1.0  # last warmup step
    assert lr_at(4, cfg, 14) == 1.0  # first decay step
    assert lr_at(9, cfg, 14) == pytest.approx(0.55)  # halfway: 0.1 + 0.9 * 0.5
    assert lr_at(13, cfg, 14) == pytest.approx(0.19)  # 0.1 + 0.9 * 0.1
    assert lr_at(14, cfg, 14) == pytest.approx(0.1)
    assert lr_at(40, cfg, 14) == pytest.approx(0.1)


def test_linear_decay_without_warmup_to_zero():
    cfg = _cfg(schedule="linear")
    assert [lr_at(s, cfg, 4) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_cosine_decay():
    cfg = _cfg(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(4, cfg, 14) == 1.0
    # step 6: progress 0.2 -> 0.1 + 0.45 * (1 + cos(0.2 pi)) = 0.1 + 0.45 * 1.809017
    assert lr_at(6, cfg, 14) == pytest.approx(0.9140576, abs=1e-7)
    assert lr_at(9, cfg, 14) == pytest.approx(0.55)  # cos(pi / 2) = 0
    assert lr_at(14, cfg, 14) == pytest.approx(0.1)
    assert lr_at(20, cfg, 14) == pytest.approx(0.1)
    plain = _cfg(schedule="cosine")
    assert lr_at(1, plain, 4) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_lr_at_rejects_bad_steps():
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(0, _cfg(), 0)
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, _cfg(), 10)


def test_weight_decay_leaves_norms_and_biases_alone():
    import torch
    matrix, norm, bias = torch.zeros(3, 4), torch.ones(4), torch.zeros(3)
    assert decays(matrix) and not decays(norm) and not decays(bias)
