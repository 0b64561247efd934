"""The rollout.env keys: checked before anything starts, naming the key; an environment is a
reward source; the episode budget bounds sequences everywhere."""

import pytest

from rlhf.config import load_config
from rlhf.errors import ConfigError
from tests.unit.config.test_config_checks import QUICKSTART

ENV = ["rollout.env.path=pkg.envs:Board"]
BAD = {
    "env-on-rollout-tp": (ENV + ["rollout.tp=2"], "rollout.tp=1"),
    "max-turns": (ENV + ["rollout.max_turns=0"], "rollout.max_turns"),
    "episode-tokens": (ENV + ["rollout.max_episode_tokens=0"], "rollout.max_episode_tokens"),
    "episode-past-positions": (ENV + ["rollout.max_episode_tokens=100000"],
                               "rollout.max_episode_tokens"),
    "kwargs": (ENV + ["rollout.env.kwargs=3"], "rollout.env.kwargs"),
    "path": (["rollout.env.path=no_colon"], "rollout.env.path"),
    "timeout": (ENV + ["rollout.env.timeout_s=0"], "rollout.env.timeout_s"),
}


@pytest.fixture
def no_model_folder(tmp_path):
    return [f"model.path={tmp_path / 'model'}"]


@pytest.mark.parametrize("overrides, key", BAD.values(), ids=BAD.keys())
def test_bad_env_settings_are_rejected_naming_the_key(overrides, key, no_model_folder):
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, no_model_folder + overrides)
    assert key in str(info.value)


def test_an_environment_alone_scores_episodes(no_model_folder):
    with pytest.raises(ConfigError, match="reward.functions is empty"):
        load_config(QUICKSTART, no_model_folder + ["reward.functions=[]"])
    cfg = load_config(QUICKSTART, no_model_folder + ENV + [
        "reward.functions=[]", "rollout.max_turns=3", "rollout.env.kwargs={level: 2}"])
    assert cfg.rollout.env.kwargs == {"level": 2}
    assert cfg.rollout.max_response_tokens == 3 * cfg.rollout.max_new_tokens
    assert hash(cfg) == hash(cfg)
