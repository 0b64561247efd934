"""The log-prob gap stop (rollout.max_logprob_gap): the trainer checks the samples that a
synced engine drew with the policy it scores them with, and stops on a gap above the limit."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from rlhf.config import JobConfig, RolloutConfig
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.rollout.sampling import LogprobGapError, check_logprob_gap
from rlhf.trainer.rollout_source import VERSION
from rlhf.trainer.ppo import PPOTrainer


def test_the_decision_names_the_gap_the_limit_and_the_setting():
    check_logprob_gap(0.3, limit=1.0)
    check_logprob_gap(1.0, limit=1.0)  # at the limit: still fine
    check_logprob_gap(50.0, limit=None)  # off
    with pytest.raises(LogprobGapError, match=r"logprob_gap_max is 1\.25 .* "
                                              r"rollout\.max_logprob_gap=1:"):
        check_logprob_gap(1.25, limit=1.0)
    with pytest.raises(LogprobGapError, match="is nan"):  # NaN log-probs: a broken engine
        check_logprob_gap(float("nan"), limit=1.0)


def _batch(gaps: list[float], versions: list[int]) -> Batch:
    """One response of two tokens per sample: the second token's log-probs differ by `gap`."""
    old = Ragged.from_list([torch.tensor([-1.0, -2.0]) for _ in gaps])
    rollout = Ragged.from_list([torch.tensor([-1.0, -2.0 - g]) for g in gaps])
    return Batch({"response_ids": Ragged.from_list([[5, 6] for _ in gaps], dtype=torch.int64),
                  "old_log_probs": old, "rollout_log_probs": rollout,
                  VERSION: torch.tensor(versions, dtype=torch.int64)})


def _gap(batch: Batch, *, version: int, limit: float | None = 1.0) -> dict[str, float]:
    trainer = SimpleNamespace(cfg=dataclasses.replace(
        JobConfig(), rollout=RolloutConfig(max_logprob_gap=limit)))
    return PPOTrainer._logprob_gap(trainer, batch, version=version)


def test_a_synced_engine_far_from_the_trainer_stops_the_job():
    with pytest.raises(LogprobGapError, match=r"logprob_gap_max is 3 "):
        _gap(_batch([0.0, 3.0], [2, 2]), version=2)
    metrics = _gap(_batch([0.0, 0.5], [2, 2]), version=2)
    assert metrics["rollout/logprob_gap_max"] == pytest.approx(0.5)


def test_samples_before_the_first_sync_or_from_an_older_policy_are_not_checked():
    # version 0: model.path, which vLLM loaded itself (the first step, before any sync)
    assert _gap(_batch([3.0], [0]), version=0)["rollout/logprob_gap_max"] == pytest.approx(3.0)
    # async: a sample of policy 1 scored by policy 2 differs by the update, not by the engine
    assert _gap(_batch([3.0, 0.1], [1, 2]), version=2)["rollout/logprob_gap_max"] == 3.0
    with pytest.raises(LogprobGapError, match="is 2 "):  # the on-policy sample is the broken one
        _gap(_batch([0.1, 2.0], [1, 2]), version=2)
    assert _gap(_batch([3.0], [2]), version=2, limit=None)["rollout/logprob_gap_max"] == 3.0
