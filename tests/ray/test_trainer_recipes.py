"""The 2025-26 recipes end to end on the tiny model, a few steps each: GSPO with
sequence-level rollout correction (GRPO), CISPO with overlong shaping, truncated-response
masking and dynamic sampling (whose loader position the checkpoint records), and GSPO with a
critic (GAE)."""

import pytest

from rlhf.trainer.checkpoint import CheckpointManager
from rlhf.trainer.jobs import run_train
from rlhf.trainer.metrics import read_metrics
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(400)

# A reward with spread inside most groups even for the untrained tiny model.
REWARD = '''
def by_length(*, prompt, response, ground_truth, extra):
    return float(len(response) % 2)
'''
GRPO = {"adv_estimator": "grpo", "kl_in_reward": False, "use_kl_loss": True,
        "kl_loss_coef": 0.01}


def reward_section(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    return {"functions": [{"path": f"{tmp_path / 'reward.py'}:by_length"}]}


def test_gspo_with_sequence_level_rollout_correction(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    cfg = job_config(
        assets, tmp_path / "gspo-run", actor={"ppo_mini_batch_size": 4},
        algorithm={**GRPO, "policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"},
        rollout={"seq_tis_cap": 2.0, "reject_band": [0.5, 2.0], "token_band": [0.5, 5.0]},
        reward=reward_section(tmp_path), trainer={"total_steps": 2, "save_every": 0})
    run_train(cfg, progress=False)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # the correction needs old log-probs before the update: their own pass runs
        assert {"timing/old_log_prob", "actor/pg_loss", "actor/clipfrac",
                "rollout_corr/ess", "rollout_corr/rejected_frac", "rollout_corr/kl",
                "rollout_corr/token_masked_frac"} <= set(r)
        assert 0 < r["rollout_corr/ess"] <= 1 and 0 <= r["rollout_corr/rejected_frac"] <= 1
        # vLLM and the fp32 trainer agree closely on CPU: nothing leaves either band
        assert r["rollout_corr/rejected_frac"] == 0.0 and r["rollout_corr/kl"] < 0.05
        assert r["rollout_corr/token_masked_frac"] == 0.0


def test_cispo_overlong_masking_and_dynamic_sampling(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    cfg = job_config(
        assets, tmp_path / "dapo-run", actor={"ppo_mini_batch_size": 4},
        algorithm={**GRPO, "policy_loss": "cispo", "clip_ratio_high": 0.28,
                   "overlong_buffer": 2, "overlong_penalty": 0.5, "mask_truncated": True,
                   "dynamic_sampling": "all_equal", "max_sampling_rounds": 3},
        data={"shuffle": False},
        reward=reward_section(tmp_path), trainer={"total_steps": 2, "save_every": 2})
    run_train(cfg, progress=False)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [1, 2]
    consumed = 0
    for r in records:
        assert {"actor/pg_loss", "overlong/truncated_frac", "overlong/penalty_mean",
                "ds/groups_dropped", "ds/rounds", "ds/prompts_consumed", "ds/batch_groups",
                "rollout_corr/ess"} <= set(r)
        assert 1 <= r["ds/rounds"] <= 3
        assert r["ds/prompts_consumed"] == 4 * r["ds/rounds"]  # a full loader batch per round
        assert r["ds/batch_groups"] <= 4
        assert -0.5 <= r["overlong/penalty_mean"] <= 0
        consumed += r["ds/prompts_consumed"]
    ckpt = CheckpointManager(cfg.trainer.output_dir)
    loader = ckpt.load_state(ckpt.latest())["loader"]
    # 64 prompts in batches of 4: the saved position counts every round of both steps
    assert loader["epoch"] * 16 + loader["position"] == consumed // 4


def test_gspo_trains_with_a_critic(ray_cluster, tmp_path):
    """A sequence-level loss with GAE advantages from a critic (the default PPO setup), not
    only with group estimators: per-token advantages reach the sequence ratio's loss, and both
    networks update. (CISPO's loss reads advantages the same way, through policy_inputs.)"""
    assets = make_assets(tmp_path)
    cfg = job_config(
        assets, tmp_path / "gspo-gae", actor={"ppo_mini_batch_size": 2},
        algorithm={"adv_estimator": "gae", "policy_loss": "gspo"},
        reward=reward_section(tmp_path), trainer={"total_steps": 2, "save_every": 0,
                                                  "critic_warmup": 0})
    run_train(cfg, progress=False)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"timing/values", "timing/update_critic", "critic/value_loss"} <= set(r)
        assert r["actor/grad_norm"] > 0 and r["critic/value_loss"] > 0
        assert r["actor/pg_loss"] == r["actor/pg_loss"]  # not NaN
    # two mini-batches per step: the second one's ratio is off 1 by the first's update
    assert any(abs(r["actor/approx_kl"]) > 1e-8 for r in records)
