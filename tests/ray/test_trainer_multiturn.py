"""Multi-turn episodes end to end: a PPO step at actor tp=2 and a GRPO step at pp=2 with a
two-turn environment, and the model tokens' log-probs equal across layouts.

The log-prob gap (trainer vs vLLM) covers model tokens only: environment tokens carry no
sampling log-prob (0), so a mask that let them in would show a gap of several nats."""

import pytest

from rlhf.trainer.cli import run_train
from rlhf.trainer.metrics import read_metrics
from tests.unit.envs.scripted_env import ECHO_SPEC
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(600)

MULTITURN = {"env": {"path": ECHO_SPEC, "num_workers": 1}, "max_turns": 3,
             "max_episode_tokens": 32}


def multiturn_config(assets, out, **sections):
    return job_config(assets, out, rollout=MULTITURN, reward={"functions": []},
                      trainer={"total_steps": 1, "save_every": 0}, **sections)


def check_step(cfg):
    run_train(cfg, progress=False)
    (record,) = read_metrics(cfg.trainer.output_dir)
    assert record["env/turns"] == 2.0 and record["env/echoes"] == 1.0
    assert record["env/episode_tokens"] > record["env/model_tokens"] > 0
    assert record["env/errors"] == 0.0 and "reward/env_mean" in record
    assert record["rollout/logprob_gap_max"] < 2e-4
    return record


def test_ppo_step_at_tp2_on_multiturn_episodes(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    record = check_step(multiturn_config(assets, tmp_path / "ppo-tp2",
                                         actor={"parallel": {"tp": 2}}))
    assert "critic/value_loss" in record


def test_grpo_step_at_pp2_on_multiturn_episodes(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    check_step(multiturn_config(assets, tmp_path / "grpo-pp2", actor={"parallel": {"pp": 2}},
                                algorithm={"adv_estimator": "grpo", "kl_in_reward": False}))
