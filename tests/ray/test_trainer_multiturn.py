"""Multi-turn episodes end to end: a PPO step at actor tp=2 and a GRPO step at pp=2 with a
two-turn environment, and the model tokens' log-probs equal across layouts.

The log-prob gap (trainer vs vLLM) covers model tokens only: environment tokens carry no
sampling log-prob (0), so a mask that let them in would show a gap of several nats."""

import pytest
from transformers import AutoTokenizer

from rlhf.data.batch import Batch
from rlhf.data.dataset import PromptLoader, build_prompt_dataset
from rlhf.trainer.jobs import RoleGroups, job_workers
from rlhf.trainer.metrics import read_metrics
from rlhf.trainer.ppo import PPOTrainer
from tests.unit.envs.scripted_env import ECHO_SPEC
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(600)

MULTITURN = {"env": {"path": ECHO_SPEC, "num_workers": 1}, "max_turns": 3,
             "max_episode_tokens": 32}


def multiturn_config(assets, out, **sections):
    return job_config(assets, out, rollout=MULTITURN, reward={"functions": []},
                      trainer={"total_steps": 1, "save_every": 0}, **sections)


@pytest.fixture(scope="module")
def jobs(ray_cluster, tmp_path_factory):
    """One step each of the tp=2 PPO job and the pp=2 GRPO job; before its step, each job's
    actor scores the episodes the tp=2 actor sampled once (the same starting weights), so
    the layouts' log-probs are compared without worker groups of their own."""
    root = tmp_path_factory.mktemp("multiturn")
    assets = make_assets(root)
    configs = {"tp2": multiturn_config(assets, root / "ppo-tp2", actor={"parallel": {"tp": 2}}),
               "pp2": multiturn_config(assets, root / "grpo-pp2", actor={"parallel": {"pp": 2}},
                                       algorithm={"adv_estimator": "grpo",
                                                  "kl_in_reward": False})}
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    data = configs["tp2"].data
    prompts = next(PromptLoader(build_prompt_dataset(data.train_files, tokenizer, data),
                                batch_size=4, shuffle=False)).with_meta(seed=7)
    log_probs, records, batch = {}, {}, None
    for name, cfg in configs.items():
        roles, role_configs = job_workers(cfg)
        groups = RoleGroups(cfg, roles, job_name=f"mt-{name}", role_configs=role_configs)
        try:
            actor = groups.views["actor"]
            if batch is None:
                out = actor.generate(prompts)
                batch = prompts.repeat_interleave(cfg.rollout.n).union(
                    Batch({k: out[k] for k in out.keys()}))
            log_probs[name] = actor.compute_log_prob(batch)["old_log_probs"]
            PPOTrainer(cfg, groups.views, tokenizer=tokenizer, job_name=f"mt-{name}",
                       progress=False).fit()
        finally:
            groups.shutdown()
        records[name] = read_metrics(cfg.trainer.output_dir)
    return records, batch, log_probs, tokenizer


def check_step(records):
    (record,) = records
    assert record["env/turns"] == 2.0 and record["env/echoes"] == 1.0
    assert record["env/episode_tokens"] > record["env/model_tokens"] > 0
    assert record["env/errors"] == 0.0 and "reward/env_mean" in record
    assert record["rollout/logprob_gap_max"] < 2e-4
    return record


def test_ppo_step_at_tp2_on_multiturn_episodes(jobs):
    record = check_step(jobs[0]["tp2"])
    assert "critic/value_loss" in record


def test_grpo_step_at_pp2_on_multiturn_episodes(jobs):
    record = check_step(jobs[0]["pp2"])
    assert not any(k.startswith("critic/") for k in record)


def test_model_token_log_probs_agree_across_layouts(jobs):
    """Episodes sampled once; the tp=2 and pp=2 actors score their model tokens alike."""
    _, batch, log_probs, tokenizer = jobs
    check_streams(batch, tokenizer)
    model_T = batch["model_mask"].values.bool()
    assert 0 < int(model_T.sum()) < len(model_T)  # both kinds of token are there
    gap = (log_probs["tp2"].values - log_probs["pp2"].values)[model_T].abs().max()
    assert gap < 1e-5
    vllm_gap = (log_probs["tp2"].values - batch["rollout_log_probs"].values)[model_T].abs().max()
    assert vllm_gap < 2e-4


def check_streams(batch, tokenizer):
    """Each episode: model turn 1, then exactly the template's rendering of EchoEnv's
    observation for that turn, then model turn 2."""
    eos = tokenizer.eos_token_id
    for ids, mask in zip(batch["response_ids"].to_list(), batch["model_mask"].to_list()):
        ids, mask = ids.tolist(), mask.tolist()
        first_env = mask.index(False)
        after = first_env + mask[first_env:].index(True)
        turn1, observation = ids[:first_env], ids[first_env:after]
        assert all(mask[after:]) and len(ids) > after
        text = tokenizer.decode(turn1, skip_special_tokens=True).strip()
        expected = ("" if turn1[-1] == eos else "<|eos|>") + \
            f"<|user|>\ncheck: {text}<|eos|><|assistant|>\n"
        assert observation == tokenizer.encode(expected, add_special_tokens=False)
