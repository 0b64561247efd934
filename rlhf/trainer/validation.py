"""Validation metrics from scored answers: the greedy answer's reward, and for sampled
validation (trainer.val_sampling.n > 0) the reward of the sampled answers and pass@k, overall
and per data source when the validation set has several. Names: docs/reference/metrics.md."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from math import comb

GREEDY = "reward_mean@greedy"
SAMPLED = "reward_mean@sampled"
LEGACY_GREEDY = "val/accuracy"
"""The greedy reward mean under its first name, kept for the quickstart, its console lines
and existing dashboards: the same number as val/reward_mean@greedy."""


def pass_ks(n: int) -> list[int]:
    """The k of pass@k reported for n samples: powers of two below n, and n."""
    return sorted({k for k in (2 ** i for i in range(n.bit_length())) if k < n} | {n})


def pass_at_k(n: int, passes: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k answers drawn from the n (of
    which `passes` pass) passes: 1 - C(n - passes, k) / C(n, k)."""
    if not 0 <= passes <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= passes <= n and 1 <= k <= n, got n={n}, passes={passes}, "
                         f"k={k}")
    return 1.0 - comb(n - passes, k) / comb(n, k)


def validation_metrics(sources: Sequence[str], greedy: Sequence[float],
                       sampled: Sequence[Sequence[float]] | None = None, *,
                       pass_score: float = 1.0) -> dict[str, float]:
    """val/* metrics of prompts i with data source sources[i], greedy answer reward greedy[i]
    and sampled answer rewards sampled[i] (all prompts the same number of them)."""
    if len(sources) != len(greedy) or (sampled is not None and len(sampled) != len(greedy)):
        raise ValueError(f"got {len(sources)} sources, {len(greedy)} greedy rewards and "
                         f"{len(sampled or [])} sampled lists; give one of each per prompt")
    groups: dict[str, list[int]] = defaultdict(list)
    for i, source in enumerate(sources):
        groups[source].append(i)
    scopes = [("val/", list(range(len(greedy))))]
    if len(groups) > 1:
        scopes += [(f"val/{source}/", rows) for source, rows in sorted(groups.items())]
    metrics: dict[str, float] = {}
    for prefix, rows in scopes:
        metrics[prefix + GREEDY] = sum(greedy[i] for i in rows) / len(rows)
        if sampled:
            metrics.update(_sampled_metrics(prefix, [sampled[i] for i in rows], pass_score))
    metrics[LEGACY_GREEDY] = metrics["val/" + GREEDY]
    return metrics


def _sampled_metrics(prefix: str, rewards: list[Sequence[float]],
                     pass_score: float) -> dict[str, float]:
    n = len(rewards[0])
    if any(len(r) != n for r in rewards):
        raise ValueError("every prompt needs the same number of sampled answers")
    passes = [sum(reward >= pass_score for reward in r) for r in rewards]
    metrics = {prefix + SAMPLED: sum(map(sum, rewards)) / (n * len(rewards))}
    for k in pass_ks(n):
        metrics[f"{prefix}pass@{k}"] = sum(pass_at_k(n, c, k) for c in passes) / len(passes)
    return metrics
