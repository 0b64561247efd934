"""The user-style example in examples/custom_reward stays loadable, correct and configured."""

from pathlib import Path

import pytest

from rlhf.config import load_config
from rlhf.rewards import RewardRunner, load_reward_function

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "custom_reward"


def test_example_reward_scores_correct_and_short_answers(monkeypatch):
    monkeypatch.chdir(REPO)  # the config's path is relative to the repository root
    fn = load_reward_function("examples/custom_reward/reward.py:concise_answer")
    kwargs = dict(prompt="12+7=", ground_truth="19", extra={"data_source": "arith"})
    assert fn(response="19", **kwargs) == {"score": 1.0, "correct": 1.0, "response_chars": 2.0}
    long = fn(response="19 is the sum", **kwargs)
    assert long["score"] == pytest.approx(1.0 - 0.05 * 9) and long["correct"] == 1.0
    assert fn(response="20", **kwargs)["score"] == 0.0


def test_example_config_loads_and_runs_its_function(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(EXAMPLE / "config.yaml")
    assert [f.path for f in cfg.reward.functions] == [
        "examples/custom_reward/reward.py:concise_answer"]
    assert cfg.reward.on_error == "fallback"
    with RewardRunner.from_config(cfg.reward) as runner:
        result = runner.score(["1+1="] * 2, ["2", "3"], ["2", "2"])
    assert result.scores.tolist() == [1.0, 0.0]
    assert result.metrics["reward/concise_answer/correct"] == 0.5
