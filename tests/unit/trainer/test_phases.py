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


# ---- entries of your own, named in the config ------------------------------------------------

USER_ALGORITHMS = '''
import torch


def value_baseline(token_rewards_T, values_T, cu_seqlens, mask_T, *, gamma):
    """Reward-to-go (gamma = 1 here) minus the value, no whitening."""
    returns_T = torch.cat([seg.flip(0).cumsum(0).flip(0)
                           for seg in torch.split(token_rewards_T, cu_seqlens.diff().tolist())])
    return (returns_T - values_T) * gamma, returns_T


def best_of_group(scores_N, group_ids, cu_seqlens, mask_T):
    """1 for the best response of each group, 0 for the others, on every token."""
    best_N = torch.zeros_like(scores_N)
    for g in group_ids.unique():
        rows = (group_ids == g).nonzero().flatten()
        best_N[rows[scores_N[rows].argmax()]] = 1.0
    adv_T = best_N.repeat_interleave(cu_seqlens.diff())
    return adv_T, adv_T.clone()


def squared(logp_T, ref_logp_T):
    return (logp_T - ref_logp_T) ** 2


class Halving:
    """A KL controller that halves the coefficient every step."""

    def __init__(self, coef, *, target=None, horizon=None):
        self.coef = coef

    def update(self, current_kl, n_samples):
        self.coef /= 2

    def state_dict(self):
        return {"coef": self.coef}

    def load_state_dict(self, state):
        self.coef = state["coef"]


def token_sum(loss_T, valid_T, seg, norm):
    return (loss_T * valid_T).sum()
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_algorithms.py"
    path.write_text(USER_ALGORITHMS)
    return path


def test_an_estimator_from_a_file_gets_a_critic_because_it_takes_values(user_file):
    from rlhf.algorithms import algorithm_needs

    batch = make_batch([2, 3], n=2)
    scores = torch.tensor([1.0, 0.0])
    cfg = config(adv_estimator=f"{user_file}:value_baseline", kl_in_reward=True, kl_coef=0.5,
                 kl_penalty=f"{user_file}:squared")
    assert algorithm_needs(cfg).critic and not algorithm_needs(cfg).groups
    out, _ = compute_advantages(batch, scores, cfg, FixedKLController(0.5))
    old, ref = batch["old_log_probs"].values, batch["ref_log_probs"].values
    rewards_T = -0.5 * (old - ref) ** 2  # the file's KL estimator, folded into the rewards
    rewards_T[1] += 1.0  # sample 0's score on its last token
    want_returns = torch.cat([rewards_T[:2].flip(0).cumsum(0).flip(0),
                              rewards_T[2:].flip(0).cumsum(0).flip(0)])
    torch.testing.assert_close(out["returns"].values, want_returns.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(out["advantages"].values,
                               (want_returns - batch["values"].values).float(), atol=1e-6, rtol=0)


def test_a_group_estimator_from_a_file_compares_the_responses_of_a_prompt(user_file):
    from rlhf.algorithms import algorithm_needs

    cfg = config(adv_estimator=f"{user_file}:best_of_group")
    assert algorithm_needs(cfg).groups and not algorithm_needs(cfg).critic
    full = make_batch([2, 3, 1, 2], n=2)
    batch = Batch({k: full[k] for k in full.keys() if k != "values"})  # no critic ran
    out, _ = compute_advantages(batch, torch.tensor([0.0, 1.0, 3.0, 2.0]), cfg,
                                FixedKLController(0.0))
    assert [row.tolist() for row in out["advantages"].to_list()] == [[0, 0], [1, 1, 1], [1], [0, 0]]


def test_an_entry_from_a_file_that_cannot_take_the_trainer_s_call_is_named(user_file):
    from rlhf.algorithms import algorithm_needs
    from rlhf.config import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss: .*squared.*keywords clip_low"):
        algorithm_needs(config(adv_estimator="grpo", policy_loss=f"{user_file}:squared"))
    with pytest.raises(ConfigError, match=r"algorithm\.kl_penalty: .*has no attribute 'sqared'.*"
                                          r"did you mean squared"):
        algorithm_needs(config(adv_estimator="grpo", kl_penalty=f"{user_file}:sqared"))


def test_a_kl_controller_and_a_loss_aggregation_from_a_file_are_used(user_file):
    from rlhf.algorithms import aggregate, algorithm_needs, build_kl_controller
    from rlhf.config import ConfigError

    cfg = config(adv_estimator="grpo", kl_in_reward=True, kl_coef=0.5,
                 kl_ctrl=f"{user_file}:Halving", loss_agg_mode=f"{user_file}:token_sum")
    algorithm_needs(cfg)  # both load and take the trainer's call
    ctrl = build_kl_controller(cfg.algorithm.kl_ctrl, coef=0.5)
    _, metrics = compute_advantages(make_batch([2, 3, 1, 2], n=2),
                                    torch.tensor([0.0, 1.0, 3.0, 2.0]), cfg, ctrl)
    assert metrics["actor/kl_coef"] == 0.5 and ctrl.coef == 0.25  # used, then updated
    loss_T, mask_T = torch.arange(5.0), torch.tensor([True, True, False, True, True])
    got = aggregate(loss_T, mask_T, torch.tensor([0, 2, 5]), cfg.algorithm.loss_agg_mode)
    assert got.item() == 0 + 1 + 3 + 4
    with pytest.raises(ConfigError, match=r"kl_ctrl=.*Halving tunes the in-reward"):
        algorithm_needs(config(adv_estimator="grpo", kl_ctrl=f"{user_file}:Halving"))
