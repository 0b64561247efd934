"""The driver's recipe glue: overlong shaping of the scores, masking of truncated and
rejected responses, and the sequence-level IS weights the actor reads."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhf.config import AlgorithmConfig, RolloutConfig
from rlhf.data.batch import Batch
from rlhf.data.fields import MASK, SEQ_IS_WEIGHTS
from rlhf.data.ragged import Ragged
from rlhf.trainer.recipes import prepare_update, shape_scores

EOS = 2


def cfg_of(algorithm=None, rollout=None):
    return SimpleNamespace(algorithm=AlgorithmConfig(**(algorithm or {})),
                           rollout=RolloutConfig(max_new_tokens=4, **(rollout or {})))


def batch_of():
    # sample 0 ends with EOS at length 2; sample 1 is cut at 4 tokens; sample 2 ends with EOS
    # exactly at 4 tokens. old - rollout per token: 0.1, 0.1 | -1, -1, -1, -1 | 0, 0, 0, 0.
    responses = [[5, EOS], [5, 6, 7, 8], [5, 6, 7, EOS]]
    rollout = [[-1.0, -1.0], [-1.0] * 4, [-1.0] * 4]
    old = [[-0.9, -0.9], [-2.0] * 4, [-1.0] * 4]
    return Batch({"response_ids": Ragged.from_list(responses),
                  "rollout_log_probs": Ragged.from_list(rollout, dtype=torch.float32),
                  "old_log_probs": Ragged.from_list(old, dtype=torch.float32)})


def test_shape_scores_penalises_long_responses_and_reports_truncation():
    scores = torch.tensor([1.0, 1.0, 1.0])
    shaped, metrics = shape_scores(batch_of(), scores, cfg_of({"overlong_buffer": 2,
                                                               "overlong_penalty": 0.5}), EOS)
    # lengths 2, 4, 4 with max 4, buffer 2: 0, -0.5, -0.5
    assert shaped.tolist() == [1.0, 0.5, 0.5]
    assert metrics["overlong/truncated_frac"] == pytest.approx(1 / 3)
    assert metrics["overlong/penalty_mean"] == pytest.approx(-1 / 3)
    same, metrics = shape_scores(batch_of(), scores, cfg_of(), EOS)
    assert same.tolist() == [1.0, 1.0, 1.0] and "overlong/penalty_mean" not in metrics


def test_mask_truncated_masks_only_the_cut_response():
    batch, _ = prepare_update(batch_of(), cfg_of({"mask_truncated": True}), EOS)
    assert batch[MASK].values.tolist() == [True] * 2 + [False] * 4 + [True] * 4
    unchanged, _ = prepare_update(batch_of(), cfg_of(), EOS)
    assert MASK not in unchanged and SEQ_IS_WEIGHTS not in unchanged


def test_rejection_band_and_sequence_weights():
    cfg = cfg_of(rollout={"reject_band": (0.5, 2.0), "seq_tis_cap": 1.1})
    batch, metrics = prepare_update(batch_of(), cfg, EOS)
    # geometric means exp(0.1), exp(-1) = 0.37 (rejected), exp(0) = 1
    assert batch[MASK].values.tolist() == [True] * 2 + [False] * 4 + [True] * 4
    # sequence weights min(exp(0.2), 1.1) = 1.1, exp(-4) = 0.0183, 1, repeated on the tokens
    w = [1.1] * 2 + [math.exp(-4.0)] * 4 + [1.0] * 4
    torch.testing.assert_close(batch[SEQ_IS_WEIGHTS].values, torch.tensor(w))
    assert metrics["rollout_corr/rejected_frac"] == pytest.approx(1 / 3)
    # ESS of 1.1, e^-4, 1: (2.118316)^2 / (3 * 2.210335)
    w_n = [1.1, math.exp(-4.0), 1.0]
    expected = sum(w_n) ** 2 / (3 * sum(x * x for x in w_n))
    assert metrics["rollout_corr/ess"] == pytest.approx(expected)


def test_token_band_masks_single_tokens_and_counts_them():
    # IcePop: old - rollout per token 0.1, 0.1 | -1 x4 | 0, 0, 0, 0 and a band [0.5, 2]:
    # exp(-1) = 0.37 leaves it, token by token; one sampler log-prob moved to make a response's
    # single token leave the band while the rest of it stays
    batch = batch_of()
    rollout = batch["rollout_log_probs"].values.clone()
    rollout[6] = -2.0  # sample 2's first token: old - rollout = 1, ratio e = 2.72 > 2
    batch = batch.pop("rollout_log_probs")[1].union(Batch(
        {"rollout_log_probs": Ragged(rollout, batch["old_log_probs"].offsets)}))
    out, metrics = prepare_update(batch, cfg_of(rollout={"token_band": (0.5, 2.0)}), EOS)
    assert out[MASK].values.tolist() == [True] * 2 + [False] * 4 + [False, True, True, True]
    assert metrics["rollout_corr/token_masked_frac"] == pytest.approx(5 / 10)
    assert SEQ_IS_WEIGHTS not in out
    wide, metrics = prepare_update(batch_of(), cfg_of(rollout={"token_band": (0.3, 3.0)}), EOS)
    assert MASK not in wide and metrics["rollout_corr/token_masked_frac"] == 0.0


def test_an_existing_mask_is_narrowed_not_replaced():
    batch = batch_of().union(Batch({MASK: Ragged.from_list(
        [[True, False], [True] * 4, [True, True, False, True]])}))
    out, _ = prepare_update(batch, cfg_of({"mask_truncated": True}), EOS)
    assert out[MASK].values.tolist() == [True, False] + [False] * 4 + [True, True, False, True]
