"""Overlong penalty, truncation detection and dynamic sampling's group filters, by hand."""

import pytest
import torch

from rlhf.algorithms.group_filters import get_group_filter
from rlhf.algorithms.overlong import overlong_penalty, truncated


def test_overlong_penalty_ramps_over_the_buffer():
    lengths = torch.tensor([5, 6, 7, 8, 10])
    # max 10, buffer 4: no penalty up to 6 tokens, then -1/4 per token down to -1 at 10
    pen = overlong_penalty(lengths, max_new_tokens=10, buffer=4, penalty=1.0)
    assert pen.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    pen = overlong_penalty(lengths, max_new_tokens=10, buffer=4, penalty=0.5)
    assert pen.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(lengths, max_new_tokens=10, buffer=0, penalty=1.0).tolist() == [0.0] * 5
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, max_new_tokens=10, buffer=11, penalty=1.0)


def test_truncated_means_full_length_without_eos():
    lengths = torch.tensor([10, 10, 3, 0])
    last = torch.tensor([2, 5, 5, 0])
    assert truncated(lengths, last, max_new_tokens=10, eos_token_id=2).tolist() == [
        False, True, False, False]
    assert truncated(lengths, last, max_new_tokens=10, eos_token_id=None).tolist() == [
        True, True, False, False]


SCORES = torch.tensor([1.0, 1.0, 1.0,  0.0, 1.0, 0.0,  0.5, 0.5, 0.5,  0.0, 0.0, 0.1])


def test_all_equal_filter():
    keep = get_group_filter("all_equal")(SCORES, 3)
    assert keep.tolist() == [False, True, False, True]


def test_std_below_filter():
    # unbiased stds: 0; [0, 1, 0] -> sqrt(1/3) = 0.577; 0; [0, 0, 0.1] -> 0.0577
    keep = get_group_filter("std_below")(SCORES, 3, std_threshold=0.3)
    assert keep.tolist() == [False, True, False, False]
    keep = get_group_filter("std_below")(SCORES, 3, std_threshold=0.05)
    assert keep.tolist() == [False, True, False, True]


def test_filters_reject_a_ragged_group_split():
    with pytest.raises(ValueError, match="groups of 5"):
        get_group_filter("all_equal")(SCORES, 5)
