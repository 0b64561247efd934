"""verl reward files run unchanged: compute_score(data_source, solution_str, ground_truth,
extra_info) is recognised by its signature or declared in the config, and fed from our rows."""

import textwrap

import pytest

from rlhf.config.schema import RewardConfig, RewardFunctionConfig
from rlhf.errors import ConfigError, RLHFError
from rlhf.rewards import RewardRunner, check_reward_functions, load_reward_function

# A reward file as verl users write it (verl's custom_reward_function.path).
VERL_FILE = '''
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """GSM8K-style: the number after '####'; a bonus for the first row of each split."""
    found = re.findall(r"#### (-?[0-9]+)", solution_str)
    correct = bool(found) and found[-1] == ground_truth
    bonus = 0.5 if (extra_info or {}).get("index") == 0 else 0.0
    return {"score": float(correct) + bonus, "acc": correct, "pred": found[-1] if found else None,
            "from_gsm8k": float(data_source == "openai/gsm8k")}


def two_args(solution_str, ground_truth):
    return float(solution_str.strip() == ground_truth)


def by_kwargs(**kwargs):
    return float(kwargs["solution_str"] == kwargs["ground_truth"])


def needs_tokenizer(data_source, solution_str, ground_truth, tokenizer):
    return 0.0
'''


@pytest.fixture(scope="module")
def verl_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("verl") / "my_reward.py"
    path.write_text(textwrap.dedent(VERL_FILE))
    return path


def extra(index, source="openai/gsm8k"):
    return {"data_source": source, "ability": "math", "extra_info": {"split": "test", "index": index}}


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_verl_reward_file_runs_unchanged(verl_file, num_workers):
    cfg = RewardConfig(functions=(RewardFunctionConfig(path=f"{verl_file}:compute_score"),
                                  RewardFunctionConfig(path=f"{verl_file}:two_args", weight=2.0)),
                       num_workers=num_workers)
    with RewardRunner.from_config(cfg) as runner:
        result = runner.score(["q"] * 3, ["so #### 7", "#### 8", "7"], ["7", "7", "7"],
                              [extra(0), extra(1), extra(2, source="other")])
    assert result.function_scores["compute_score"].tolist() == [1.5, 0.0, 0.0]
    assert result.function_scores["two_args"].tolist() == [0.0, 0.0, 1.0]
    assert result.scores.tolist() == [1.5, 0.0, 2.0]
    assert result.metrics["reward/compute_score/acc"] == pytest.approx(1 / 3)
    assert result.metrics["reward/compute_score/from_gsm8k"] == pytest.approx(2 / 3)
    assert "reward/compute_score/pred" not in result.metrics  # text is for debugging only


def test_the_convention_can_be_declared(verl_file):
    call = {"prompt": "q", "response": "7", "ground_truth": "7", "extra": {"data_source": "x"}}
    declared = load_reward_function(f"{verl_file}:by_kwargs", convention="verl")
    assert declared(**call) == 1.0
    # the same **kwargs function read by our convention gets our names and fails on verl's
    with pytest.raises(KeyError, match="solution_str"):
        load_reward_function(f"{verl_file}:by_kwargs")(**call)
    assert load_reward_function(f"{verl_file}:two_args", convention="auto")(**call) == 1.0
    with pytest.raises(RLHFError, match=r"does not accept prompt, response, extra .*or verl's "
                                        r"def compute_score\(data_source, solution_str"):
        load_reward_function(f"{verl_file}:two_args", convention="rlhf")


def test_verl_signatures_that_cannot_work_are_named(verl_file):
    with pytest.raises(RLHFError, match=r"needs_tokenizer.* \(verl convention\) .*requires "
                                        r"tokenizer, which verl never passes"):
        load_reward_function(f"{verl_file}:needs_tokenizer")
    with pytest.raises(ConfigError, match=r"reward.functions\[1\].path: .*needs_tokenizer"):
        check_reward_functions([f"{verl_file}:compute_score", f"{verl_file}:needs_tokenizer"])
    check_reward_functions([f"{verl_file}:by_kwargs"], conventions=["verl"])
    with pytest.raises(RLHFError, match="convention must be one of auto, rlhf, verl"):
        load_reward_function(f"{verl_file}:two_args", convention="openrlhf")
