"""The calling convention of reward functions, and the check of what they return.

A reward function is any Python callable that accepts these keyword arguments::

    def my_reward(*, prompt: str, response: str, ground_truth, extra: dict) -> float | dict:
        ...

- prompt: the question as the dataset gives it (a string prompt, or the content of the last
  user message of a chat prompt); the chat template is not applied.
- response: the model's generated text after the prompt, special tokens removed.
- ground_truth: the row's ground-truth field, as stored in the dataset (any JSON value).
- extra: the row's other fields, e.g. {"data_source": "gsm8k", "level": 3}; data_source is
  always there ("unknown" when the row has none). Changes to it are not kept.

It returns the sample's score: a finite number (bool counts as 1.0 / 0.0, so `return
response == answer` works), or a dict with a finite numeric "score" plus other numeric
entries that are logged as metrics, averaged per batch as `reward/<function>/<key>` over the
samples that report the key. Non-numeric dict entries (strings, None) are ignored, so a
function may carry debugging text. NaN, infinity, None, strings, tensors and dicts without
"score" are errors that name the function, the sample and the value.

verl's convention, `compute_score(data_source, solution_str, ground_truth, extra_info)`, is
taken as well (`VerlReward`): the loader recognises it by a `solution_str` parameter, or
reward.functions[].convention declares it.
"""

import math
import numbers
from typing import Any

REWARD_KWARGS = ("prompt", "response", "ground_truth", "extra")
EXPECTED_SIGNATURE = ("def fn(*, prompt: str, response: str, ground_truth, extra: dict) "
                      "-> float | dict")
VERL_KWARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_SIGNATURE = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None) "
                  "-> float | dict")
# Keys the runner writes itself under reward/<function>/; a function may not report them.
RESERVED_METRICS = ("score", "errors", "timeouts", "fallbacks")


class BadReturn(ValueError):
    """A reward function returned something that is not a score; the message says what."""


def _as_number(value: Any) -> float | None:
    """value as a float when it is a real number (bools and numpy scalars included), else None."""
    if isinstance(value, numbers.Real):  # bool, int, float, Fraction, numpy ints and floats
        return float(value)
    # numpy.bool_ is not a numbers.Real; recognised without importing numpy in workers.
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        kind = getattr(getattr(value, "dtype", None), "kind", None)
        if kind is not None and kind in "biuf":
            return float(value)
    return None


def _finite(value: Any, what: str) -> float:
    try:
        number = _as_number(value)
    except OverflowError:
        number = math.inf
    if number is None:
        hint = "; call .item() on a tensor" if hasattr(value, "item") else ""
        raise BadReturn(f"{what} is {_show(value)} ({type(value).__name__}), not a number{hint}")
    if not math.isfinite(number):
        raise BadReturn(f"{what} is {_show(value)}; scores and metrics must be finite")
    return number


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def parse_reward_output(value: Any) -> tuple[float, dict[str, float]]:
    """(score, numeric metrics) from a reward function's return value; BadReturn if invalid."""
    if isinstance(value, dict):
        if "score" not in value:
            raise BadReturn(f"the returned dict {_show(value)} has no 'score' entry; "
                            f"return {{'score': <number>, ...metrics}}")
        score = _finite(value["score"], "its 'score'")
        metrics = {}
        for key, metric in value.items():
            if key == "score" or _as_number(metric) is None:
                continue  # non-numeric entries are documented as ignored
            if not isinstance(key, str):
                raise BadReturn(f"metric key {key!r} is not a string")
            if key in RESERVED_METRICS:
                raise BadReturn(f"metric key {key!r} is reserved (the runner reports "
                                f"{', '.join(RESERVED_METRICS)}); rename it")
            metrics[key] = _finite(metric, f"metric {key!r}")
        return score, metrics
    return _finite(value, "the returned value"), {}


class VerlReward:
    """A verl reward function called with our keyword arguments: data_source and extra_info
    come from `extra` (extra_info is the row's verl field, {} without one), solution_str is
    the response. Only the verl arguments the function names are passed."""

    def __init__(self, fn, names: tuple[str, ...] = VERL_KWARGS):
        self.fn, self.names = fn, names
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, *, prompt: str, response: str, ground_truth, extra: dict):
        verl_args = {"data_source": extra.get("data_source"), "solution_str": response,
                     "ground_truth": ground_truth, "extra_info": extra.get("extra_info") or {}}
        return self.fn(**{name: verl_args[name] for name in self.names})
