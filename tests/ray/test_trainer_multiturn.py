"""Multi-turn episodes end to end: a PPO step at actor tp=2 and a GRPO step at pp=2 with a
two-turn environment, and the model tokens' log-probs equal across layouts.

The log-prob gap (trainer vs vLLM) covers model tokens only: environment tokens carry no
sampling log-prob (0), so a mask that let them in would show a gap of several nats."""

import pytest
from transformers import AutoTokenizer

from rlhf.controller import ResourcePool, WorkerGroup
from rlhf.data.batch import Batch
from rlhf.data.dataset import PromptLoader, build_prompt_dataset
from rlhf.trainer.jobs import run_train
from rlhf.trainer.metrics import read_metrics
from tests.unit.envs.scripted_env import ECHO_SPEC
from tests.unit.trainer.jobs import job_config, make_assets
from workers.actor import ActorWorker

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


def test_model_token_log_probs_agree_across_layouts(ray_cluster, tmp_path):
    """Episodes sampled once; the tp=2 and pp=2 actors score their model tokens alike."""
    assets = make_assets(tmp_path)
    configs = {name: multiturn_config(assets, tmp_path / name, actor={"parallel": plan})
               for name, plan in (("tp2", {"tp": 2}), ("pp2", {"pp": 2}))}
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    data = configs["tp2"].data
    prompts = next(PromptLoader(build_prompt_dataset(data.train_files, tokenizer, data),
                                batch_size=4, shuffle=False)).with_meta(seed=7)
    log_probs, batch = {}, None
    for name, cfg in configs.items():
        pool = ResourcePool(f"mt-{name}", ranks_per_node=2, use_gpu=False)
        group = WorkerGroup(pool, {"actor": (ActorWorker, {"config": cfg})}, job_name=f"mt-{name}")
        try:
            if batch is None:
                out = group.generate(prompts)
                batch = prompts.repeat_interleave(cfg.rollout.n).union(
                    Batch({k: out[k] for k in out.keys()}))
            log_probs[name] = group.compute_log_prob(batch)["old_log_probs"]
        finally:
            group.shutdown()
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
