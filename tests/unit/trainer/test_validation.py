"""Validation metrics: greedy reward mean (and its old name), sampled reward mean and pass@k,
overall and per data source, checked against numbers worked out by hand."""

from pathlib import Path

import pytest

from rlhf.config import ConfigError, load_config
from rlhf.trainer.validation import pass_at_k, pass_ks, validation_metrics

QUICKSTART = Path(__file__).parents[3] / "configs" / "quickstart.yaml"


def test_pass_at_k_by_hand():
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(1 / 4)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 3) == pytest.approx(1.0)  # any 3 of 4 include a pass
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_metrics_overall_and_per_data_source():
    sources = ["gsm8k", "gsm8k", "math"]
    greedy = [1.0, 0.0, 0.5]
    sampled = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.9, 0.0]]
    m = validation_metrics(sources, greedy, sampled, pass_score=1.0)
    assert m["val/reward_mean@greedy"] == m["val/accuracy"] == pytest.approx(0.5)
    assert m["val/reward_mean@sampled"] == pytest.approx(3.9 / 12)
    # passes per prompt: 1, 0, 2 of 4 (0.9 is below pass_score)
    assert m["val/pass@1"] == pytest.approx((1 / 4 + 0 + 2 / 4) / 3)
    assert m["val/pass@2"] == pytest.approx(((1 - 3 / 6) + 0 + (1 - 1 / 6)) / 3)
    assert m["val/pass@4"] == pytest.approx(2 / 3)
    assert m["val/gsm8k/reward_mean@greedy"] == 0.5 and m["val/math/reward_mean@greedy"] == 0.5
    assert m["val/gsm8k/pass@4"] == 0.5 and m["val/math/pass@2"] == pytest.approx(5 / 6)
    # one data source: no per-source copies of the same numbers; greedy only: no sampled ones
    assert set(validation_metrics(["a", "a"], [1.0, 0.0])) == {"val/reward_mean@greedy",
                                                               "val/accuracy"}


def test_the_sampling_settings_are_checked():
    cfg = load_config(QUICKSTART, ["trainer.val_sampling.n=8", "trainer.val_sampling.temperature=0.6"])
    assert cfg.trainer.val_sampling.n == 8 and cfg.trainer.val_sampling.pass_score == 1.0
    with pytest.raises(ConfigError, match=r"trainer.val_sampling.temperature must be in \(0, 2\]"):
        load_config(QUICKSTART, ["trainer.val_sampling.temperature=0"])
