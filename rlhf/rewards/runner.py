"""Score a batch of responses with weighted reward functions, in worker processes.

`RewardRunner` loads every function in the driver first (so a bad spec fails before any
process starts), then runs them in a `RewardProcesses` (see rlhf.rewards.processes for the timeout
design). num_workers=0 runs them in the calling process instead, for debugging with
breakpoints and prints; timeouts are then not enforced.
"""

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Literal

import torch
from torch import Tensor

from rlhf.errors import RLHFError
from rlhf.rewards.loader import load_reward_function
from rlhf.rewards.processes import RewardProcesses
from rlhf.rewards.worker import Outcome, call_reward
from rlhf.trace import span

OnError = Literal["raise", "fallback"]


@dataclass(frozen=True)
class RewardResult:
    """Scores of one batch: the weighted total, each function's own scores, and metrics."""

    scores: Tensor
    """(N,) float32: sum over functions of weight * score (fallbacks included)."""
    function_scores: dict[str, Tensor]
    """Function name -> (N,) float32 unweighted scores, fallback_score where a call failed."""
    metrics: dict[str, float]
    """reward/<function>/<key>: batch means of score and reported metrics; counts of errors,
    timeouts and fallbacks."""


def combine_scores(function_scores: Sequence[Tensor], weights: Sequence[float], *,
                   rm_scores: Tensor | None = None, rm_weight: float = 1.0) -> Tensor:
    """sum_i weights[i] * function_scores[i] (+ rm_weight * rm_scores): (N,) float32 on CPU."""
    if len(function_scores) != len(weights):
        raise ValueError(f"{len(function_scores)} score tensors but {len(weights)} weights")
    parts = list(zip(function_scores, weights))
    if rm_scores is not None:
        parts.append((rm_scores, rm_weight))
    if not parts:
        raise ValueError("combine_scores needs at least one score tensor")
    shapes = {tuple(scores.shape) for scores, _ in parts}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"score tensors must all be (N,) of one length, got shapes {shapes}")
    # float64 accumulation: the order of functions must not change the total in float32
    total = sum(float(w) * s.detach().to("cpu", torch.float64) for s, w in parts)
    return total.to(torch.float32)


def function_names(specs: Sequence[str]) -> list[str]:
    """Short unique names for metrics: the function name, qualified by its module when shared."""
    def qualified(spec: str) -> str:
        target, _, name = spec.rpartition(":")
        module = PurePath(target).stem if target.endswith(".py") else target.rsplit(".", 1)[-1]
        return f"{module}.{name}"

    short = [spec.rpartition(":")[2] for spec in specs]
    names = [s if short.count(s) == 1 else qualified(spec) for s, spec in zip(short, specs)]
    return [n if names.count(n) == 1 else spec for n, spec in zip(names, specs)]


class RewardRunner:
    """Weighted rule-based reward functions run in num_workers processes with a per-call timeout.

    functions: (spec, weight) pairs; none for a job scored by a reward model alone (every
    total is then 0 and the model's score is added by the caller). conventions: how each is
    called (auto, rlhf, verl; see rlhf.rewards.protocol), auto for all when None. on_error "raise" stops at
    the first failure; "fallback" gives the failed call fallback_score (before weighting) and
    counts it in the metrics.
    """

    def __init__(self, functions: Sequence[tuple[str, float]], *, num_workers: int = 2,
                 timeout_s: float = 10.0, on_error: OnError = "raise",
                 fallback_score: float = 0.0, conventions: Sequence[str] | None = None):
        if on_error not in ("raise", "fallback"):
            raise RLHFError(f"on_error must be 'raise' or 'fallback', got {on_error!r}")
        if num_workers < 0 or not timeout_s > 0 or not math.isfinite(fallback_score):
            raise RLHFError(f"need num_workers >= 0, timeout_s > 0 and a finite fallback_score; "
                            f"got {num_workers}, {timeout_s}, {fallback_score}")
        self.specs = [spec for spec, _ in functions]
        self.weights = [float(weight) for _, weight in functions]
        self.names = function_names(self.specs)
        self.on_error, self.fallback_score, self.timeout_s = on_error, fallback_score, timeout_s
        loads = list(zip(self.specs, conventions or ["auto"] * len(self.specs), strict=True))
        self._functions = [load_reward_function(spec, convention=c) for spec, c in loads]
        self._processes = (RewardProcesses(loads, num_workers=num_workers, timeout_s=timeout_s)
                           if num_workers > 0 and self.specs else None)
        self._closed = False

    @classmethod
    def from_config(cls, cfg) -> "RewardRunner":
        """A runner for a RewardConfig's functions, workers, timeout and error policy."""
        return cls([(fn.path, fn.weight) for fn in cfg.functions], num_workers=cfg.num_workers,
                   timeout_s=cfg.timeout_s, on_error=cfg.on_error,
                   fallback_score=cfg.fallback_score,
                   conventions=[fn.convention for fn in cfg.functions])

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              ground_truths: Sequence, extras: Sequence[dict] | None = None) -> RewardResult:
        """Score every sample i = (prompts[i], responses[i], ground_truths[i], extras[i])."""
        if self._closed:
            raise RLHFError("this RewardRunner is closed")
        n = len(responses)
        extras = [{}] * n if extras is None else [{} if e is None else e for e in extras]
        if not len(prompts) == len(ground_truths) == len(extras) == n:
            raise ValueError(f"got {len(prompts)} prompts, {n} responses, {len(ground_truths)} "
                             f"ground truths and {len(extras)} extras; give one of each per sample")
        samples = [{"prompt": p, "response": r, "ground_truth": g, "extra": e}
                   for p, r, g, e in zip(prompts, responses, ground_truths, extras)]
        outcomes: list[list[Outcome | None]] = [[None] * n for _ in self.specs]
        with span("reward_functions", samples=n), contextlib.closing(
                self._outcomes(samples)) as results:
            for index, f, outcome in results:
                if outcome[0] != "ok" and self.on_error == "raise":
                    raise RLHFError(self._describe_failure(f, index, samples[index], outcome))
                outcomes[f][index] = outcome
        return self._collect(outcomes, n)

    def _outcomes(self, samples: list[dict]) -> Iterator[tuple[int, int, Outcome]]:
        if self._processes is not None:
            yield from self._processes.run(samples)
            return
        for index, sample in enumerate(samples):
            for f, fn in enumerate(self._functions):
                yield index, f, call_reward(fn, sample)

    def _describe_failure(self, f: int, index: int, sample: dict, outcome: Outcome) -> str:
        shown = repr(sample["response"])
        shown = shown if len(shown) <= 120 else shown[:120] + "..."
        fix = ("Make the function faster or raise reward.timeout_s" if outcome[0] == "timeout"
               else "Fix the function")
        return (f"reward function {self.names[f]!r} ({self.specs[f]}) failed on sample {index} "
                f"(response {shown}): {outcome[1]}\n{fix}, or set reward.on_error: fallback to "
                f"give such samples reward.fallback_score")

    def _collect(self, outcomes: list[list[Outcome]], n: int) -> RewardResult:
        function_scores, metrics = {}, {}
        for name, column in zip(self.names, outcomes):
            scores = [o[1] if o[0] == "ok" else self.fallback_score for o in column]
            sums, counts = defaultdict(float), defaultdict(int)
            for outcome in column:
                for key, value in (outcome[2] if outcome[0] == "ok" else {}).items():
                    sums[key] += value
                    counts[key] += 1
            errors = sum(o[0] == "error" for o in column)
            timeouts = sum(o[0] == "timeout" for o in column)
            prefix = f"reward/{name}/"
            if scores:
                metrics[prefix + "score"] = sum(scores) / len(scores)
            metrics.update({prefix + key: sums[key] / counts[key] for key in sorted(sums)})
            metrics.update({prefix + "errors": float(errors), prefix + "timeouts": float(timeouts),
                            prefix + "fallbacks": float(errors + timeouts)})
            function_scores[name] = torch.tensor(scores, dtype=torch.float32)
        total = (combine_scores(list(function_scores.values()), self.weights) if self.specs
                 else torch.zeros(n, dtype=torch.float32))
        return RewardResult(scores=total, function_scores=function_scores, metrics=metrics)

    def close(self) -> None:
        """Stop the worker processes; safe to call twice."""
        if self._processes is not None and not self._closed:
            self._processes.close()
        self._closed = True

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
