"""Driver-side phases: advantages from scores (with and without KL in the reward), metrics."""

import dataclasses

import pytest
import torch

from rlhf.algorithms import FixedKLController
from rlhf.config import AlgorithmConfig, JobConfig, RolloutConfig
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.trainer.ppo import batch_metrics, compute_advantages, step_seed


def make_batch(lengths, *, n):
    responses = Ragged.from_list([list(range(3, 3 + k)) for k in lengths], dtype=torch.int64)
    offsets = responses.offsets
    total = int(offsets[-1])
    torch.manual_seed(0)
    return Batch({
        "prompt_ids": Ragged.from_list([[1, 2]] * len(lengths), dtype=torch.int64),
        "response_ids": responses,
        "old_log_probs": Ragged(-torch.rand(total), offsets),
        "ref_log_probs": Ragged(-torch.rand(total), offsets),
        "values": Ragged(torch.randn(total), offsets),
    })


def config(**algo):
    return dataclasses.replace(JobConfig(), algorithm=AlgorithmConfig(**algo),
                               rollout=RolloutConfig(n=2))


def test_grpo_advantages_are_group_normalised_scores_on_every_token():
    batch = make_batch([2, 3, 1, 2], n=2)
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    out, _ = compute_advantages(batch, scores, config(adv_estimator="grpo"),
                                FixedKLController(0.0))
    adv = [row.tolist() for row in out["advantages"].to_list()]
    a = 0.5 / (2 ** -0.5 + 1e-6)  # (1 - 0.5) / std([1, 0]) with Bessel's correction
    assert adv[0] == pytest.approx([a, a]) and adv[1] == pytest.approx([-a] * 3)
    assert adv[2] == [0.0] and adv[3] == [0.0, 0.0]


def test_kl_in_reward_penalises_tokens_and_updates_the_controller():
    batch = make_batch([2, 3], n=2)
    scores = torch.tensor([1.0, 0.0])
    cfg = config(adv_estimator="gae", kl_in_reward=True, kl_coef=0.5)
    out, metrics = compute_advantages(batch, scores, cfg, FixedKLController(0.5))
    kl_T = batch["old_log_probs"].values - batch["ref_log_probs"].values
    assert metrics["actor/kl_coef"] == 0.5
    assert metrics["reward/kl_penalty_mean"] == pytest.approx(
        0.5 * torch.stack([kl_T[:2].sum(), kl_T[2:].sum()]).mean().item(), rel=1e-5)
    # gamma = lam = 1 returns: every token's return is its sample's remaining reward
    returns = out["returns"].to_list()
    want0 = 1.0 - 0.5 * kl_T[:2].flip(0).cumsum(0).flip(0)
    torch.testing.assert_close(returns[0], want0.float(), atol=1e-5, rtol=0)


def test_batch_metrics_and_step_seed():
    batch = make_batch([2, 4], n=1)
    m = batch_metrics(batch)
    assert m["response_length/mean"] == 3.0 and m["tokens/total"] == 10.0
    diff = batch["old_log_probs"].values - batch["ref_log_probs"].values
    assert m["actor/kl_ref"] == pytest.approx(diff.mean().item())
    assert "actor/kl" not in m
    assert step_seed(0, 3) == step_seed(0, 3) != step_seed(0, 4) != step_seed(1, 4)
