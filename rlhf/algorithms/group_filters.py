"""Dynamic sampling's group filters (DAPO): which prompt groups carry a learning signal.

A filter takes the (n,) scores of a batch whose groups are `group_size` consecutive samples
(prompt-major, as the rollout returns them) and returns a (n // group_size,) bool, True = keep.
Registered under the name `algorithm.dynamic_sampling` uses, or named there as
'package.module:function' / 'path/to/file.py:function'; a filter whose `std_threshold` has no
default needs a positive `algorithm.dynamic_sampling_std`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlhf.algorithms.registry import lookup, register

_FILTERS: dict[str, Callable[..., Tensor]] = {}
NO_FILTER = "off"  # algorithm.dynamic_sampling's value for no filter (keep every group)


def register_group_filter(name: str):
    """Decorator: make `fn(scores_N, group_size, *, std_threshold) -> keep_G` a filter."""
    return register(_FILTERS, "group filter", name)


def get_group_filter(name: str) -> Callable[..., Tensor]:
    """The filter registered under `name`, or the user function a 'module:function' names
    (ValueError listing the registered names otherwise)."""
    return lookup(_FILTERS, "group filter", name)


def _groups(scores_N: Tensor, group_size: int) -> Tensor:
    if group_size < 1 or scores_N.numel() % group_size:
        raise ValueError(f"{scores_N.numel()} scores do not split into groups of {group_size}")
    return scores_N.double().reshape(-1, group_size)


@register_group_filter("all_equal")
def keep_unequal(scores_N: Tensor, group_size: int, *, std_threshold: float = 0.0) -> Tensor:
    """Drop groups whose scores are all exactly equal (every response right, or every one
    wrong): their group-relative advantages are zero."""
    del std_threshold
    scores_GK = _groups(scores_N, group_size)
    return scores_GK.amax(1) > scores_GK.amin(1)


@register_group_filter("std_below")
def keep_spread(scores_N: Tensor, group_size: int, *, std_threshold: float) -> Tensor:
    """Drop groups whose score std (unbiased, as GRPO's) is below `std_threshold`; a group of
    one has no spread and is dropped."""
    scores_GK = _groups(scores_N, group_size)
    if group_size == 1:
        return scores_GK.new_zeros(scores_GK.shape[0], dtype=torch.bool)
    return scores_GK.std(1) >= std_threshold
