"""Roles keep their own plans with context parallelism: a PPO job (GAE critic, KL in the
reward) on 2 ranks with the actor at cp=2 (dp=1) and the critic and reference at cp=1 (dp=2)
takes real steps, the actor sharing each prompt between its samples (the default). The
trainer's log-probs of the sampled tokens, computed on cp shards and gathered back, match the
ones vLLM sampled with (the policy synced into vLLM from the cp=2 engine), and both roles
train."""

import math

import pytest

from rlhf.trainer.jobs import RoleGroups, job_workers, load_tokenizer
from rlhf.trainer.ppo import PPOTrainer
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(400)


def test_ppo_with_the_actor_at_cp2_and_the_critic_at_cp1(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    cfg = job_config(assets, tmp_path / "cp-run",
                     actor={"parallel": {"cp": 2}},  # shared prompts on: rollout.n=2
                     trainer={"total_steps": 2, "save_every": 0, "val_every": 0})
    assert (cfg.actor.parallel.cp, cfg.critic.parallel.cp) == (2, 1)
    roles, role_configs = job_workers(cfg)
    groups = RoleGroups(cfg, roles, job_name="cp-test", role_configs=role_configs)
    try:
        layouts = {name: view.layout for name, view in groups.views.items()}
        assert (layouts["actor"].cp, layouts["actor"].dp) == (2, 1)
        assert (layouts["critic"].cp, layouts["critic"].dp) == (1, 2)
        records = PPOTrainer(cfg, groups.views, tokenizer=load_tokenizer(cfg.model.path),
                             job_name="cp-test", progress=False).fit()
    finally:
        groups.shutdown()
    assert (tmp_path / "cp-run" / "checkpoints" / "step_2").is_dir()  # the cp=2 actor saved
    steps = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["actor/grad_norm"] > 0 and r["critic/value_loss"] > 0
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/entropy"])
    # vLLM samples from the policy the cp=2 trainer scores: the gap is rounding only
    assert steps[0]["rollout/logprob_gap_mean"] < 1e-3
    assert steps[0]["actor/kl_ref"] == 0.0  # the reference (cp=1) equals the start policy
