"""Built-in rewards (arith, gsm8k, boxed math), their number parsing and the return-value check."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from rlhf.rewards import parse_reward_output
from rlhf.rewards.arith import exact_match
from rlhf.rewards.builtin import parse_number, strip_end_markers
from rlhf.rewards.gsm8k import extract_answer
from rlhf.rewards.gsm8k import score as gsm8k_score
from rlhf.rewards.math import boxed, last_boxed
from rlhf.rewards.protocol import BadReturn


def run(fn, response, truth):
    return fn(prompt="q", response=response, ground_truth=truth, extra={})


@pytest.mark.parametrize("text, value", [
    ("42", 42), ("-7", -7), ("+3", 3), (" 1,234 ", 1234), ("1,234,567", 1234567),
    ("3.50", Fraction(7, 2)), (".5", Fraction(1, 2)), ("2.", 2), ("3/4", Fraction(3, 4)),
    ("-6/8", Fraction(-3, 4)), ("\\frac{3}{4}", Fraction(3, 4)), ("-\\frac{1}{2}", Fraction(-1, 2)),
    ("\\dfrac{10}{4}", Fraction(5, 2)), ("\\frac12", Fraction(1, 2)),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1,2", "12,34", "1/0", "\\frac{1}{0}", "x=3", "1e5",
                                  "\\frac{a}{b}", "1.2.3"])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


def test_strip_end_markers():
    assert strip_end_markers(" 16<|eos|>\n") == "16"
    assert strip_end_markers("16 </s><|endoftext|> ") == "16"
    assert strip_end_markers("<|eos|>16") == "<|eos|>16"


@pytest.mark.parametrize("response, truth, score, format_error", [
    ("16", "16", 1.0, 0.0), (" 16\n", "16", 1.0, 0.0), ("16<|eos|>", "16", 1.0, 0.0),
    ("16.", "16", 1.0, 0.0), ("-4", "-4", 1.0, 0.0), ("016", "16", 1.0, 0.0),
    ("17", "16", 0.0, 0.0), ("4", "-4", 0.0, 0.0), ("16 apples", "16", 0.0, 1.0),
    ("", "16", 0.0, 1.0), ("sixteen", "16", 0.0, 1.0), ("16.0", "16", 0.0, 1.0),
    ("1 6", "16", 0.0, 1.0),
])
def test_arith_exact_match(response, truth, score, format_error):
    assert run(exact_match, response, truth) == {"score": score, "format_error": format_error}


def test_arith_ground_truth_must_be_an_integer():
    with pytest.raises(ValueError):
        run(exact_match, "3", "three")


@pytest.mark.parametrize("response, truth, score, mode", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "3 + 4 = 7\n#### 7", 1.0, "strict"),
    ("So the total is 1,234 dollars. #### 1,234", "#### 1234", 1.0, "strict"),
    ("#### 8 but I meant 7", "#### 7", 0.0, "strict"),  # strict wins over a later number
    ("#### 7.0", "#### 7", 1.0, "strict"),
    ("He pays $12.50 in total.", "#### 12.5", 1.0, "flexible"),
    ("3 cats and 5 dogs make 8 animals.", "#### 8", 1.0, "flexible"),
    ("first 8, then 9", "#### 8", 0.0, "flexible"),
    ("The loss is -3.", "#### -3", 1.0, "flexible"),
    ("I do not know.", "#### 3", 0.0, "none"),
])
def test_gsm8k(response, truth, score, mode):
    result = run(gsm8k_score, response, truth)
    assert result["score"] == score
    assert (result["strict"], result["flexible"], result["no_answer"]) == (
        float(mode == "strict"), float(mode == "flexible"), float(mode == "none"))


def test_gsm8k_plain_ground_truth_and_extraction():
    assert run(gsm8k_score, "#### 42", "42")["score"] == 1.0
    assert run(gsm8k_score, "#### 42", 42)["score"] == 1.0
    assert extract_answer("a 1,000,000 b") == ("1,000,000", "flexible")
    with pytest.raises(ValueError, match="no number"):
        run(gsm8k_score, "#### 1", "#### many")


@pytest.mark.parametrize("text, content", [
    ("so \\boxed{42}.", "42"), ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{2}", "2"), ("\\boxed{{a}^{b}}", "{a}^{b}"),
    ("\\fbox{7}", "7"), ("\\boxed{open", None), ("no box", None),
])
def test_last_boxed(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize("response, truth, score", [
    ("The answer is $\\boxed{42}$.", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac12", 1.0),
    ("\\boxed{3.50}", "7/2", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),
    ("\\boxed{43}", "42", 0.0),
    ("\\boxed{x^{2} + 1}", "x^{2}+1", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{\\text{(B)}}", "(B)", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{(1,2)}", "(2,1)", 0.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{3}", 0.0),
    ("wrong \\boxed{5} then right \\boxed{6}", "6", 1.0),
    ("solution ... \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("with answer \\boxed{5}", "Thus the answer is $\\boxed{5}$.", 1.0),
])
def test_boxed(response, truth, score):
    result = run(boxed, response, truth)
    assert result == {"score": score, "no_box": 0.0}


@pytest.mark.parametrize("response", ["The answer is 42.", "\\boxed{42", "\\boxed 42"])
def test_boxed_without_a_complete_box(response):
    assert run(boxed, response, "42") == {"score": 0.0, "no_box": 1.0}


@pytest.mark.parametrize("value, expected", [
    (1, (1.0, {})), (0.25, (0.25, {})), (True, (1.0, {})), (False, (0.0, {})),
    (np.float32(0.5), (0.5, {})), (np.int64(3), (3.0, {})), (np.bool_(True), (1.0, {})),
    (Fraction(1, 4), (0.25, {})),
    ({"score": 1, "acc": True, "len": 3, "note": "text", "none": None},
     (1.0, {"acc": 1.0, "len": 3.0})),
])
def test_parse_reward_output_accepts(value, expected):
    assert parse_reward_output(value) == expected


@pytest.mark.parametrize("value, message", [
    (math.nan, "nan; scores and metrics must be finite"), (math.inf, "inf"),
    (None, "None (NoneType), not a number"), ("1.0", "'1.0' (str), not a number"),
    ({}, "has no 'score'"), ({"acc": 1.0}, "has no 'score'"), ({"score": None}, "'score'"),
    ({"score": 1.0, "acc": math.nan}, "metric 'acc'"), ({"score": 1.0, "errors": 2}, "reserved"),
    (torch.tensor(1.0), "call .item()"), (10 ** 400, "finite"), ([1.0], "not a number"),
])
def test_parse_reward_output_rejects(value, message):
    with pytest.raises(BadReturn, match=None) as info:
        parse_reward_output(value)
    assert message in str(info.value)
