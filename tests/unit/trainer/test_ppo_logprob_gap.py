"""The log-prob gap stop (rollout.max_logprob_gap_p99): the trainer checks the samples that a
synced engine drew with the policy it scores them with, and stops when their p99 gap is above
the limit (by the engine's dtype when the setting is null)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from rlhf.config import JobConfig, RolloutConfig
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.rollout.sampling import LogprobGapError, check_logprob_gap
from rlhf.trainer.ppo import PPOTrainer
from rlhf.trainer.rollout_source import VERSION


def test_the_decision_names_the_statistic_the_limit_and_the_setting():
    check_logprob_gap(0.3, limit=1.0, dtype=torch.bfloat16)
    check_logprob_gap(1.0, limit=1.0, dtype=torch.bfloat16)  # at the limit: still fine
    with pytest.raises(LogprobGapError, match=r"rollout/logprob_gap_p99 is 1\.25 .* above the "
                                              r"limit 1 \(rollout\.max_logprob_gap_p99; null "
                                              r"picks 1 for bfloat16\)"):
        check_logprob_gap(1.25, limit=1.0, dtype=torch.bfloat16)
    with pytest.raises(LogprobGapError, match=r"limit 0\.5 .* null picks 0\.1 for float32"):
        check_logprob_gap(0.7, limit=0.5, dtype=torch.float32)
    with pytest.raises(LogprobGapError, match="is nan"):  # NaN log-probs: a broken engine
        check_logprob_gap(float("nan"), limit=1.0, dtype=torch.bfloat16)


def _batch(gaps: list[float], versions: list[int], *, tokens: int = 2) -> Batch:
    """One response of `tokens` tokens per sample: its last token's log-probs differ by `gap`."""
    row = torch.linspace(-1.0, -2.0, tokens)
    old = Ragged.from_list([row.clone() for _ in gaps])
    rollout = Ragged.from_list([torch.cat([row[:-1], row[-1:] - g]) for g in gaps])
    return Batch({"response_ids": Ragged.from_list([[5] * tokens for _ in gaps],
                                                   dtype=torch.int64),
                  "old_log_probs": old, "rollout_log_probs": rollout,
                  VERSION: torch.tensor(versions, dtype=torch.int64)})


def _gap(batch: Batch, *, version: int, limit: float | None = None) -> dict[str, float]:
    # trainer.device auto without Ray on a machine without a GPU: the actor runs in float32
    trainer = SimpleNamespace(cfg=dataclasses.replace(
        JobConfig(), rollout=RolloutConfig(max_logprob_gap_p99=limit)))
    return PPOTrainer._logprob_gap(trainer, batch, version=version)


def test_a_synced_engine_far_from_the_trainer_stops_the_job():
    with pytest.raises(LogprobGapError, match=r"logprob_gap_p99 is 3 "):
        _gap(_batch([0.0, 3.0], [2, 2]), version=2, limit=1.0)
    metrics = _gap(_batch([0.0, 0.5], [2, 2]), version=2, limit=1.0)
    assert metrics["rollout/logprob_gap_max"] == pytest.approx(0.5)
    assert metrics["rollout/logprob_gap_p99"] == pytest.approx(0.5)  # 4 tokens: the largest
    # null: float32's limit, 0.1
    with pytest.raises(LogprobGapError, match=r"is 0\.5 .* above the limit 0\.1 "):
        _gap(_batch([0.0, 0.5], [2, 2]), version=2)


def test_a_few_far_tokens_do_not_stop_the_job_but_show_in_the_max():
    # 100 samples of 10 tokens: 10 tokens (1%) 3 nats off, the rest exact; p99 stays 0
    gaps = [3.0] * 10 + [0.0] * 90
    metrics = _gap(_batch(gaps, [2] * 100, tokens=10), version=2, limit=1.0)
    assert metrics["rollout/logprob_gap_p99"] == 0.0
    assert metrics["rollout/logprob_gap_max"] == pytest.approx(3.0)
    assert metrics["rollout/logprob_gap_mean"] == pytest.approx(30.0 / 1000)
    with pytest.raises(LogprobGapError, match=r"logprob_gap_p99 is 3 "):  # 11 tokens: 1.1%
        _gap(_batch([3.0] * 11 + [0.0] * 89, [2] * 100, tokens=10), version=2, limit=1.0)


def test_samples_before_the_first_sync_or_from_an_older_policy_are_not_checked():
    # version 0: model.path, which vLLM loaded itself (the first step, before any sync)
    assert _gap(_batch([3.0], [0]), version=0)["rollout/logprob_gap_max"] == pytest.approx(3.0)
    # async: a sample of policy 1 scored by policy 2 differs by the update, not by the engine
    assert _gap(_batch([3.0, 0.0], [1, 2]), version=2)["rollout/logprob_gap_max"] == 3.0
    with pytest.raises(LogprobGapError, match="is 2 "):  # the on-policy sample is the broken one
        _gap(_batch([0.0, 2.0], [1, 2]), version=2)
    assert _gap(_batch([3.0], [2]), version=2, limit=1e9)["rollout/logprob_gap_max"] == 3.0
