"""Bad configs are rejected with a ConfigError that names the offending dotted key."""

import dataclasses
import json
from pathlib import Path

import pytest

from rlhf.algorithms import algorithm_needs
from rlhf.config import ConfigError, load_config
from rlhf.config.checks import check_config

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"

# (overrides on top of configs/quickstart.yaml: 2 CPU ranks, tiny llama with 4 layers, 4 heads,
#  2 kv heads, head size 32, 512 positions; gae; batch 16 prompts x 4; mini-batch 8),
# then a dotted key the message must name.
BAD = {
    "unknown-key": (["actor.optim.learning_rate=1e-6"], "actor.optim.learning_rate"),
    "unknown-section": (["actr.parallel.tp=2"], "actr"),
    "int-from-text": (["actor.parallel.tp=two"], "actor.parallel.tp"),
    "int-from-bool": (["trainer.total_steps=true"], "trainer.total_steps"),
    "int-from-fraction": (["data.train_batch_size=16.5"], "data.train_batch_size"),
    "float-from-text": (["actor.optim.lr=fast"], "actor.optim.lr"),
    "float-nan": (["actor.optim.lr=.nan"], "actor.optim.lr"),
    "float-inf": (["reward.timeout_s=.inf"], "reward.timeout_s"),
    "bool-from-int": (["trainer.ray_metrics=1"], "trainer.ray_metrics"),
    "bool-from-yes": (["rollout.enforce_eager=yes"], "rollout.enforce_eager"),
    "str-from-list": (["data.prompt_key=[a]"], "data.prompt_key"),
    "literal": (["actor.optim.schedule=cos"], "actor.optim.schedule"),
    "null-not-optional": (["actor.optim.lr=null"], "actor.optim.lr"),
    "tuple-length": (["actor.optim.betas=[0.9]"], "actor.optim.betas"),
    "tuple-item": (["data.val_files=[a, 3]"], "data.val_files[1]"),
    "mapping-expected": (["actor.parallel=4"], "actor.parallel"),
    "reward-item-key": (["reward.functions=[{path: 'm:f', wieght: 2}]"],
                        "reward.functions[0].wieght"),
    "reward-item-missing-path": (["reward.functions=[{weight: 2}]"], "reward.functions[0].path"),
    "tiny-post-init": (["model.tiny.hidden_size=130"], "model.tiny.hidden_size"),
    "tiny-vocab": (["model.tiny.vocab_size=100"], "model.tiny.vocab_size"),
    "pool-not-divisible": (["actor.parallel.pp=3"], "actor.parallel.pp"),
    "tp-vs-heads": (["model.tiny.num_heads=6", "model.tiny.num_kv_heads=6",
                     "model.tiny.hidden_size=192", "trainer.ranks_per_node=4",
                     "actor.parallel.tp=4", "rollout.n=2"], "actor.parallel.tp"),
    "tp-vs-intermediate": (["model.tiny.intermediate_size=255", "actor.parallel.tp=2"],
                           "actor.parallel.tp"),
    "tp-vs-kv-heads": (["model.tiny.num_heads=8", "model.tiny.hidden_size=256",
                        "model.tiny.num_kv_heads=1", "actor.parallel.tp=2"], "actor.parallel.tp"),
    "critic-tp-vs-heads": (["trainer.ranks_per_node=4", "critic.parallel.tp=4", "rollout.n=2"],
                           "critic.parallel.tp"),
    "layers-below-stages": (["trainer.ranks_per_node=8", "actor.parallel.pp=8", "rollout.n=2"],
                            "actor.parallel.pp"),
    "vpp-needs-pp": (["actor.parallel.vpp=2"], "actor.parallel.vpp"),
    "ep-vs-dp": (["actor.parallel.ep=3"], "actor.parallel.ep"),
    "ep-needs-experts": (["actor.parallel.ep=2"], "actor.parallel.ep"),
    "ep-positive": (["actor.parallel.ep=0"], "actor.parallel.ep"),
    "ep-vs-experts": (["model.tiny.arch=qwen3_moe", "trainer.ranks_per_node=6", "rollout.n=2",
                       "actor.parallel.ep=3"], "actor.parallel.ep=3 does not divide the model's 8"),
    "cost-model-vs-ep": (["model.tiny.arch=qwen3_moe", "actor.parallel.ep=2",
                          "trainer.micro_batching=cost_model"], "which trainer.micro_batching"),
    "cp-positive": (["actor.parallel.cp=0"], "actor.parallel.cp"),
    "cp-vs-pool": (["actor.parallel.cp=3"],
                   "actor.parallel.tp * actor.parallel.cp * actor.parallel.pp = 3"),
    "cp-attention-literal": (["actor.parallel.cp_attention=ring"], "actor.parallel.cp_attention"),
    "ulysses-vs-heads": (["model.tiny.num_heads=6", "model.tiny.hidden_size=192",
                          "trainer.ranks_per_node=4", "rollout.n=2", "actor.parallel.cp=4",
                          "actor.parallel.cp_attention=ulysses"],
                         "actor.parallel.cp_attention=all_gather"),
    "vpp-stages-vs-layers": (["actor.parallel.pp=2", "actor.parallel.vpp=4"], "actor.parallel.vpp"),
    "layers-per-stage-length": (["actor.parallel.pp=2", "actor.parallel.layers_per_stage=[4]"],
                                "actor.parallel.layers_per_stage"),
    "layers-per-stage-zero": (["actor.parallel.pp=2", "actor.parallel.layers_per_stage=[0,4]"],
                              "actor.parallel.layers_per_stage"),
    "layers-per-stage-sum": (["actor.parallel.pp=2", "actor.parallel.layers_per_stage=[1,2]"],
                             "actor.parallel.layers_per_stage"),
    "sequence-parallel-needs-tp": (["ref.parallel.sequence_parallel=true"],
                                   "ref.parallel.sequence_parallel"),
    "batch-vs-mini-batch": (["actor.ppo_mini_batch_size=6"], "actor.ppo_mini_batch_size"),
    "critic-batch-vs-mini-batch": (["critic.ppo_mini_batch_size=24"], "critic.ppo_mini_batch_size"),
    "mini-batch-vs-dp": (["trainer.ranks_per_node=3"], "actor.ppo_mini_batch_size"),
    "micro-batch": (["actor.micro_batch_size=5"], "actor.micro_batch_size"),
    "grpo-needs-n": (["algorithm.adv_estimator=grpo", "rollout.n=1"], "rollout.n"),
    "rloo-greedy": (["algorithm.adv_estimator=rloo", "rollout.temperature=0"],
                    "rollout.temperature"),
    "dual-clip": (["algorithm.clip_ratio_c=1.0"], "algorithm.clip_ratio_c"),
    "clip-low": (["algorithm.clip_ratio_low=1.0"], "algorithm.clip_ratio_low"),
    "sequence-vs-positions": (["data.max_prompt_length=510", "actor.max_tokens_per_micro_batch=600",
                              "critic.max_tokens_per_micro_batch=600",
                              "ref.max_tokens_per_micro_batch=600"], "data.max_prompt_length"),
    "sequence-vs-micro-batch": (["ref.max_tokens_per_micro_batch=36"],
                                "ref.max_tokens_per_micro_batch"),
    "rollout-tp-vs-actor": (["trainer.device=cuda", "rollout.tp=4"], "rollout.tp"),
    "rollout-tp-on-cpu": (["rollout.tp=2"], "rollout.tp"),
    "cpu-head-size": (["model.tiny.hidden_size=64"], "model.tiny"),
    "separate-needs-world-size": (["critic.placement=separate"], "critic.world_size"),
    "rollout-separate-needs-world-size": (["rollout.placement=separate"], "rollout.world_size"),
    "rollout-world-vs-tp": (["trainer.device=cuda", "rollout.placement=separate",
                             "rollout.world_size=3", "rollout.tp=2"], "rollout.world_size=3"),
    "async-needs-separate": (["trainer.async_mode=one_step"], "rollout.placement=separate"),
    "one-step-is-staleness-1": (["trainer.async_mode=one_step", "trainer.max_staleness=2"],
                                "trainer.max_staleness"),
    "staleness-without-bounded": (["trainer.max_staleness=3"], "trainer.max_staleness=3"),
    "min-tokens-while-streaming": (["trainer.async_mode=streaming", "rollout.placement=separate",
                                    "rollout.world_size=1", "rollout.min_new_tokens=4"],
                                   "rollout.min_new_tokens"),
    "colocated-forbids-world-size": (["ref.world_size=2"], "ref.world_size"),
    "separate-world-vs-plan": (["critic.placement=separate", "critic.world_size=3",
                                "critic.parallel.tp=2"],
                               "critic.world_size"),
    "no-reward": (["reward.functions=[]"], "reward.functions"),
    "reward-path-syntax": (["reward.functions=[{path: rlhf.rewards.arith}]"],
                           "reward.functions[0].path"),
    "reward-path-function": (["reward.functions=[{path: 'rewards.py:2fast'}]"],
                             "reward.functions[0].path"),
    "reward-duplicate": (["reward.functions=[{path: 'm:f'}, {path: 'm:f'}]"], "reward.functions"),
    "reward-timeout": (["reward.timeout_s=0"], "reward.timeout_s"),
    "lr-positive": (["critic.optim.lr=0"], "critic.optim.lr"),
    "betas-range": (["actor.optim.betas=[0.9, 1.0]"], "actor.optim.betas"),
    "warmup-vs-steps": (["actor.optim.warmup_steps=200"], "actor.optim.warmup_steps"),
    "min-lr-ratio": (["actor.optim.min_lr_ratio=1.5"], "actor.optim.min_lr_ratio"),
    "grad-clip": (["actor.optim.grad_clip=0"], "actor.optim.grad_clip"),
    "adaptive-kl-target": (["algorithm.kl_ctrl=adaptive"], "algorithm.kl_target"),
    "adaptive-kl-in-reward": (["algorithm.kl_ctrl=adaptive", "algorithm.kl_target=6.0",
                               "algorithm.kl_in_reward=false"], "algorithm.kl_in_reward"),
    "kl-ctrl-unknown": (["algorithm.kl_ctrl=pid"], "algorithm.kl_ctrl"),
    "loss-agg-unknown": (["algorithm.loss_agg_mode=mean"], "algorithm.loss_agg_mode"),
    "kl-twice": (["algorithm.use_kl_loss=true"], "algorithm.use_kl_loss"),
    "val-needs-files": (["data.val_files=[]"], "data.val_files"),
    "no-train-files": (["data.train_files=[]"], "data.train_files"),
    "top-p": (["rollout.top_p=0"], "rollout.top_p"),
    "top-k": (["rollout.top_k=0"], "rollout.top_k"),
    "temperature": (["rollout.temperature=-0.5"], "rollout.temperature"),
    "sync-bucket": (["rollout.sync_bucket_mb=0"], "rollout.sync_bucket_mb"),
    "tis-cap": (["rollout.tis_cap=0.5"], "rollout.tis_cap"),
    "float16-on-cpu": (["actor.dtype=float16"], "actor.dtype"),
    "ray-address-and-cpus": (["ray.address=auto"], "ray.num_cpus"),
    "dashboard-port": (["ray.dashboard_port=70000"], "ray.dashboard_port"),
    "gamma": (["algorithm.gamma=1.5"], "algorithm.gamma"),
    "empty-output-dir": (["trainer.output_dir=''"], "trainer.output_dir"),
    "override-into-list": (["reward.functions.0.weight=2"], "reward.functions"),
}


def load_checked(overrides):
    """Both stages of the checks: load_config's, then the registry entries' (algorithm_needs,
    which also checks the critic when the estimator takes values)."""
    cfg = load_config(QUICKSTART, overrides)
    algorithm_needs(cfg)
    return cfg


@pytest.fixture
def no_model_folder(tmp_path):
    # The quickstart model folder may exist on this machine; point elsewhere so the checks read
    # model.tiny and every case below is deterministic.
    return [f"model.path={tmp_path / 'model'}"]


@pytest.mark.parametrize("overrides, key", BAD.values(), ids=BAD.keys())
def test_bad_config_is_rejected_naming_the_key(overrides, key, no_model_folder):
    with pytest.raises(ConfigError) as info:
        load_checked(no_model_folder + overrides)
    assert key in str(info.value)


def test_the_bad_configs_are_bad_only_because_of_their_overrides(no_model_folder):
    # Guards the table above: without the overrides the same config loads.
    assert load_config(QUICKSTART, no_model_folder).trainer.pool_size == 2


def test_several_problems_are_reported_together(no_model_folder):
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, no_model_folder + ["trainer.ranks_per_node=3"])
    message = str(info.value)
    assert message.startswith("2 problems")
    for key in ("actor.ppo_mini_batch_size", "ref"):
        assert key in message
    # The critic exists because gae takes values: its problems come from the registry's check.
    cfg = dataclasses.replace(load_config(QUICKSTART, no_model_folder), trainer=dataclasses.replace(
        load_config(QUICKSTART, no_model_folder).trainer, ranks_per_node=3))
    with pytest.raises(ConfigError, match="critic.ppo_mini_batch_size"):
        algorithm_needs(cfg)


@pytest.mark.parametrize("ranks, ep", [(2, 1), (4, 2)])
def test_context_parallel_with_experts_is_accepted(ranks, ep, no_model_folder):
    # cp splits an MoE model's tokens as a dense one's; at ep > 1 the routed experts' grads are
    # summed over edp x cp (docs/guides/context-parallelism.md).
    cfg = load_checked(no_model_folder + [
        "model.tiny.arch=qwen3_moe", f"trainer.ranks_per_node={ranks}", "actor.parallel.cp=2",
        f"actor.parallel.ep={ep}"])
    assert (cfg.actor.parallel.cp, cfg.actor.parallel.ep) == (2, ep)


@pytest.mark.parametrize("role", ["actor", "critic", "sft"])
def test_context_parallel_keeps_shared_prompts(role, no_model_folder):
    # a shard's shared prompts are rows of the gathered keys (docs/guides/context-parallelism.md)
    cfg = load_checked(no_model_folder + [f"{role}.parallel.cp=2"])
    assert getattr(cfg, role).share_prompts and getattr(cfg, role).parallel.cp == 2


@pytest.mark.parametrize("ranks", [2, 4])
def test_ulysses_is_accepted_where_kv_heads_split_or_are_copied(ranks, no_model_folder):
    # 2 KV heads: split over cp=2, each copied to 2 ranks at cp=4 (rlhf.parallel.ulysses)
    cfg = load_checked(no_model_folder + [
        f"trainer.ranks_per_node={ranks}", f"actor.parallel.cp={ranks}", "rollout.n=2",
        "actor.parallel.cp_attention=ulysses"])
    assert cfg.actor.parallel.cp_attention == "ulysses"


def test_unused_roles_are_not_checked(no_model_folder):
    # grpo has no critic and no KL term here, so their (bad) plans do not matter.
    cfg = load_config(QUICKSTART, no_model_folder + [
        "algorithm.adv_estimator=grpo", "algorithm.kl_in_reward=false",
        "critic.parallel.tp=3", "ref.parallel.pp=3"])
    assert cfg.critic.parallel.tp == 3 and not algorithm_needs(cfg).critic


def test_model_checks_are_skipped_without_folder_or_tiny(no_model_folder):
    cfg = load_config(QUICKSTART, no_model_folder + [
        "model.tiny=null", "trainer.ranks_per_node=6", "actor.parallel.tp=3",
        "critic.parallel.tp=3",
        "ref.parallel.tp=3", "rollout.n=3", "actor.ppo_mini_batch_size=16",
        "critic.ppo_mini_batch_size=16"])
    assert cfg.actor.parallel.tp == 3


def _write_model(folder, **overrides):
    folder.mkdir(parents=True)
    config = {"num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
              "hidden_size": 192, "intermediate_size": 384, "max_position_embeddings": 64}
    config.update(overrides)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_model_folder_config_json_wins_over_tiny(tmp_path):
    model = _write_model(tmp_path / "model")
    # With tiny's 4 heads tp 3 would fail on attention heads too; the folder's 6 heads do not.
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, [f"model.path={model}", "trainer.ranks_per_node=6",
                                 "actor.parallel.tp=3", "rollout.n=3",
                                 "actor.ppo_mini_batch_size=16", "critic.ppo_mini_batch_size=16"])
    message = str(info.value)
    assert "2 kv heads" in message and "config.json" in message and "attention heads" not in message
    with pytest.raises(ConfigError, match="actor.parallel.pp"):
        load_config(QUICKSTART, [f"model.path={model}", "actor.parallel.pp=2",
                                 "actor.parallel.vpp=2"])
    with pytest.raises(ConfigError, match="max_position_embeddings 64"):
        load_config(QUICKSTART, [f"model.path={model}", "data.max_prompt_length=60"])


def test_model_folder_without_config_json(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(ConfigError, match="model.path.*no config.json"):
        load_config(QUICKSTART, [f"model.path={tmp_path / 'model'}"])


def test_model_folder_with_broken_config_json(tmp_path):
    model = _write_model(tmp_path / "model")
    (model / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="model.path"):
        load_config(QUICKSTART, [f"model.path={model}"])


def test_critic_model_path_is_checked_against_its_own_config(tmp_path, no_model_folder):
    critic = _write_model(tmp_path / "critic", num_attention_heads=3, num_key_value_heads=1,
                          max_position_embeddings=512)
    with pytest.raises(ConfigError) as info:
        load_checked(no_model_folder + [f"critic.model_path={critic}", "critic.parallel.tp=2"])
    assert "critic.parallel.tp" in str(info.value) and "actor" not in str(info.value)


def test_head_size_rule_applies_only_on_cpu(no_model_folder):
    cfg = load_config(QUICKSTART, no_model_folder + ["model.tiny.hidden_size=64",
                                                     "trainer.device=cuda"])
    assert cfg.model.tiny.head_dim == 16


def test_check_config_accepts_a_directly_built_valid_config(no_model_folder):
    check_config(load_config(QUICKSTART, no_model_folder))
