"""The recipe keys (policy loss, rollout correction, overlong, dynamic sampling): bad values are
rejected naming the dotted key; good ones load and reach the fields the code reads."""

import pytest

from rlhf.algorithms import algorithm_needs, policy_clip
from rlhf.config import ConfigError, load_config
from rlhf.trainer.step_splits import fuse_old_log_probs
from tests.unit.config.test_config_checks import QUICKSTART

GRPO = ["algorithm.adv_estimator=grpo", "rollout.n=4"]

BAD = {
    "policy-loss-name": (["algorithm.policy_loss=dapo"], "algorithm.policy_loss"),
    "gspo-clip-low": (["algorithm.gspo_clip_low=0"], "algorithm.gspo_clip_low"),
    "gspo-clip-high": (["algorithm.gspo_clip_high=-1e-4"], "algorithm.gspo_clip_high"),
    "seq-tis-cap": (["rollout.seq_tis_cap=0.5"], "rollout.seq_tis_cap"),
    "reject-band-order": (["rollout.reject_band=[1.5, 2.0]"], "rollout.reject_band"),
    "reject-band-length": (["rollout.reject_band=[0.5]"], "rollout.reject_band"),
    "token-band-order": (["rollout.token_band=[0.2, 0.9]"], "rollout.token_band"),
    "overlong-buffer-negative": (["algorithm.overlong_buffer=-1"], "algorithm.overlong_buffer"),
    "overlong-buffer-vs-max": (["algorithm.overlong_buffer=100", "rollout.max_new_tokens=64"],
                               "algorithm.overlong_buffer"),
    "overlong-penalty": (["algorithm.overlong_penalty=-1"], "algorithm.overlong_penalty"),
    "dynamic-sampling-name": (GRPO + ["algorithm.dynamic_sampling=yes"],
                              "algorithm.dynamic_sampling"),
    "dynamic-sampling-std": (GRPO + ["algorithm.dynamic_sampling=std_below"],
                             "algorithm.dynamic_sampling_std"),
    "dynamic-sampling-needs-groups": (["algorithm.adv_estimator=gae",
                                       "algorithm.dynamic_sampling=all_equal"],
                                      "algorithm.dynamic_sampling"),
    "dynamic-sampling-vs-async": (GRPO + ["algorithm.dynamic_sampling=all_equal",
                                          "trainer.async_mode=one_step",
                                          "rollout.placement=separate", "rollout.world_size=1"],
                                  "refills a step's batch"),
    "sampling-rounds": (GRPO + ["algorithm.max_sampling_rounds=0"],
                        "algorithm.max_sampling_rounds"),
}


@pytest.fixture
def no_model_folder(tmp_path):
    return [f"model.path={tmp_path / 'model'}"]


@pytest.mark.parametrize("overrides, key", BAD.values(), ids=BAD.keys())
def test_bad_recipe_value_is_rejected_naming_the_key(overrides, key, no_model_folder):
    with pytest.raises(ConfigError) as info:  # load_config's checks, then the registries'
        algorithm_needs(load_config(QUICKSTART, no_model_folder + overrides))
    assert key in str(info.value)


@pytest.mark.parametrize("key, typo, guess, choices", [
    ("policy_loss", "gpso", "gspo", "cispo, gspo, ppo"),
    ("adv_estimator", "gpro", "grpo", "gae, grpo, reinforce_plus_plus"),
    ("kl_loss_type", "k33", "k3", "abs, k1, k2, k3"),
    ("dynamic_sampling", "std_bellow", "std_below", "all_equal, std_below"),
    ("loss_agg_mode", "token-mena", "token-mean", "seq-mean-token-sum-norm, token-mean"),
    ("kl_ctrl", "adaptiv", "adaptive", "adaptive, fixed"),
])
def test_a_misspelt_entry_names_the_closest_and_every_registered_choice(key, typo, guess,
                                                                        choices, no_model_folder):
    cfg = load_config(QUICKSTART, no_model_folder + GRPO + [f"algorithm.{key}={typo}"])
    with pytest.raises(ConfigError) as info:
        algorithm_needs(cfg)
    message = str(info.value)
    assert message.startswith(f"algorithm.{key}: ") and f"did you mean {guess!r}" in message
    assert choices in message and "path/to/file.py:function" in message


def test_recipe_keys_load(no_model_folder):
    cfg = load_config(QUICKSTART, no_model_folder + GRPO + [
        "algorithm.policy_loss=gspo", "algorithm.gspo_clip_low=1e-3",
        "rollout.reject_band=[0.5, 2]", "rollout.seq_tis_cap=3",
        "algorithm.overlong_buffer=4", "algorithm.mask_truncated=true",
        "algorithm.dynamic_sampling=std_below", "algorithm.dynamic_sampling_std=0.1"])
    assert policy_clip(cfg.algorithm) == (1e-3, 4e-4)  # gspo's entry names its clip keys
    assert cfg.rollout.reject_band == (0.5, 2.0) and cfg.rollout.seq_tis_cap == 3.0
    assert cfg.algorithm.dynamic_sampling == "std_below"
    ppo = load_config(QUICKSTART, no_model_folder + ["algorithm.policy_loss=cispo"])
    assert policy_clip(ppo.algorithm) == (ppo.algorithm.clip_ratio_low,
                                         ppo.algorithm.clip_ratio_high)


def test_sequence_correction_needs_the_old_log_prob_pass(no_model_folder):
    # On-policy GRPO would take old log-probs from the update; the driver needs them first.
    base = no_model_folder + GRPO + ["algorithm.kl_in_reward=false", "algorithm.ppo_epochs=1",
                                      "data.train_batch_size=16", "actor.ppo_mini_batch_size=16"]
    cfg = load_config(QUICKSTART, base)
    assert fuse_old_log_probs(cfg, algorithm_needs(cfg), step=1)
    for extra in ("rollout.seq_tis_cap=2", "rollout.reject_band=[0.5, 2]",
                  "rollout.token_band=[0.5, 5]"):
        cfg = load_config(QUICKSTART, base + [extra])
        assert not fuse_old_log_probs(cfg, algorithm_needs(cfg), step=1)
