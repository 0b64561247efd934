"""The environment interface of multi-turn rollouts.

One `Env` object lives for one episode. It is built from `rollout.env.kwargs`, told about its
dataset row (`reset`), then receives every model turn (`step`) and answers with the next
observation, a reward and whether the episode is over. The dataset row's prompt is the first
observation; an observation is a text (one user message) or a list of chat messages, which the
rollout renders through the chat template for that turn only and appends to the episode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

Observation = str | list[dict[str, str]] | None


@dataclass
class StepResult:
    """What an environment returns for one model turn."""

    observation: Observation = None
    """Text (a user message) or chat messages appended before the next turn; None: nothing."""
    reward: float = 0.0
    """This turn's reward; an episode's rewards are summed into its score."""
    done: bool = False
    """True ends the episode after this turn."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers summed over the episode's turns and averaged over episodes as env/<key>."""


class Env:
    """Base class of an environment (`rollout.env.path: 'pkg.module:Class'` or
    'file.py:Class'); subclasses override `reset` and `step`."""

    def __init__(self, **kwargs: Any):
        if kwargs:
            raise TypeError(f"{type(self).__name__} takes no kwargs, got {sorted(kwargs)}; "
                            f"define __init__ to accept rollout.env.kwargs")

    def reset(self, *, prompt: Any, ground_truth: Any, extra: dict) -> None:
        """Start an episode from its dataset row (the prompt is already the first observation)."""

    def step(self, *, text: str, token_ids: list[int]) -> StepResult:
        """The model's turn (decoded text without special tokens, and its exact token ids)."""
        raise NotImplementedError(f"{type(self).__name__} must define step(*, text, token_ids)")


class BadStep(Exception):
    """An environment returned something that is not a StepResult-like value."""


def check_step_result(value: Any) -> StepResult:
    """`value` as a StepResult, checked (raises BadStep naming what is wrong)."""
    if not isinstance(value, StepResult):
        raise BadStep(f"step returned a {type(value).__name__}, expected a StepResult")
    obs = value.observation
    if not (obs is None or isinstance(obs, str) or (
            isinstance(obs, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                          and isinstance(m.get("content"), str) for m in obs))):
        raise BadStep(f"observation must be None, a str or a list of {{'role', 'content'}} "
                      f"messages, got {obs!r:.200}")
    if isinstance(value.reward, bool) or not isinstance(value.reward, (int, float)) \
            or not math.isfinite(value.reward):
        raise BadStep(f"reward must be a finite number, got {value.reward!r}")
    if not isinstance(value.done, bool):
        raise BadStep(f"done must be a bool, got {value.done!r}")
    for key, number in value.metrics.items():
        if not isinstance(key, str) or isinstance(number, bool) or \
                not isinstance(number, (int, float)) or not math.isfinite(number):
            raise BadStep(f"metrics must map names to finite numbers, got {key!r}: {number!r}")
    return StepResult(obs, float(value.reward), value.done,
                      {k: float(v) for k, v in value.metrics.items()})
