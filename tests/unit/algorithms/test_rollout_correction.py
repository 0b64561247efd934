"""Rollout correction: sequence TIS weights, band rejection, the token band, ESS and the
metrics, on hand-worked numbers."""

import math

import pytest
import torch

from rlhf.algorithms.rollout_correction import (
    effective_sample_size,
    keep_tokens_in_band,
    reject_outside_band,
    rollout_correction_metrics,
    seq_tis_weights,
)

D = torch.float64


def t(xs, dtype=D):
    return torch.tensor(xs, dtype=dtype)


# old - rollout per token: sample 0: 0.1, 0.2 (sum 0.3, mean 0.15); sample 1: -0.5, -0.4, -0.3
# and a masked token with a huge gap (sum -1.2, mean -0.4); sample 2: 2.0.
ROLLOUT = t([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
DIFF = t([0.1, 0.2, -0.5, -0.4, -0.3, 50.0, 2.0])
OLD = ROLLOUT + DIFF
CU = t([0, 2, 6, 7], torch.int32)
MASK = t([1, 1, 1, 1, 1, 0, 1], torch.bool)


def test_seq_tis_weights_are_capped_sequence_ratios():
    w = seq_tis_weights(OLD, ROLLOUT, MASK, CU, cap=2.0)
    # exp(0.3) = 1.349859, exp(-1.2) = 0.301194, exp(2) = 7.39 capped at 2
    torch.testing.assert_close(w, t([1.3498588075760032, 0.30119421191220214, 2.0]))
    with pytest.raises(ValueError, match="at least 1"):
        seq_tis_weights(OLD, ROLLOUT, MASK, CU, cap=0.5)


def test_band_rejection_uses_the_per_token_geometric_mean():
    # geometric means exp(0.15) = 1.16, exp(-0.4) = 0.67, exp(2) = 7.39 against [0.7, 1.5]
    keep = reject_outside_band(OLD, ROLLOUT, MASK, CU, low=0.7, high=1.5)
    assert keep.tolist() == [True, False, False]
    keep = reject_outside_band(OLD, ROLLOUT, MASK, CU, low=0.6, high=8.0)
    assert keep.tolist() == [True, True, True]
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        reject_outside_band(OLD, ROLLOUT, MASK, CU, low=1.2, high=1.5)


def test_a_sample_without_valid_tokens_is_kept():
    keep = reject_outside_band(t([5.0, 0.0]), t([0.0, 0.0]), t([0, 1], torch.bool),
                               t([0, 1, 2], torch.int32), low=0.9, high=1.1)
    assert keep.tolist() == [True, True]


def test_effective_sample_size():
    assert effective_sample_size(t([0.0, 0.0, 0.0])) == pytest.approx(1.0)
    # w = 1, 0: (1)^2 / (2 * 1) = 0.5
    assert effective_sample_size(t([0.0, -math.inf])) == pytest.approx(0.5)
    # w = 1, 3: 16 / (2 * 10) = 0.8, and a common factor (here e^800) does not matter
    assert effective_sample_size(t([800.0, 800.0 + math.log(3.0)])) == pytest.approx(0.8)
    assert effective_sample_size(t([])) == 1.0


def test_metrics_of_capped_weights_rejection_and_kl():
    keep = torch.tensor([True, False, False])
    metrics = rollout_correction_metrics(OLD, ROLLOUT, MASK, CU, cap=2.0, keep_N=keep)
    # w = 1.349859, 0.301194, 2: (3.651053)^2 / (3 * 5.912837) = 0.751483
    assert metrics["rollout_corr/ess"] == pytest.approx(0.7514829574156459, abs=1e-9)
    assert metrics["rollout_corr/rejected_frac"] == pytest.approx(2 / 3)
    # k3 = exp(d) - 1 - d over the 6 valid tokens: (0.005171 + 0.021403 + 0.106531 + 0.070320
    # + 0.040818 + 4.389056) / 6
    assert metrics["rollout_corr/kl"] == pytest.approx(0.7722164502660763, abs=1e-9)


def test_metrics_without_correction_report_the_raw_ratios():
    metrics = rollout_correction_metrics(OLD, OLD, MASK, CU)
    assert metrics == {"rollout_corr/ess": pytest.approx(1.0),
                       "rollout_corr/rejected_frac": 0.0, "rollout_corr/kl": 0.0}


def test_token_band_keeps_each_token_by_its_own_ratio():
    # token ratios exp(0.1, 0.2, -0.5, -0.4, -0.3, 50, 2) = 1.11, 1.22, 0.61, 0.67, 0.74, huge,
    # 7.39 against [0.65, 1.5]; the mask does not matter here (the driver ANDs it after)
    keep = keep_tokens_in_band(OLD, ROLLOUT, low=0.65, high=1.5)
    assert keep.tolist() == [True, True, False, True, True, False, False]
    assert keep_tokens_in_band(OLD, ROLLOUT, low=0.5, high=8.0).tolist() == [True] * 5 + [
        False, True]
    with pytest.raises(ValueError, match="token band"):
        keep_tokens_in_band(OLD, ROLLOUT, low=1.1, high=2.0)
