"""How a driver call is split over a role's ranks and how the ranks' results are collected.

A worker method declares its mode with `@register(dispatch=Dispatch.DP_COMPUTE)`; the driver
loop then calls it like a local function. Routing is pure (no actors involved): `route_call`
turns driver arguments into per-rank arguments, `collect` turns per-rank results into one value.

Which rank holds which (dp, pp, tp) coordinate, and which rank answers for a DP group, is the
role's `Layout`'s to say (rlhf.parallel.layout), the same object the ParallelMesh reads.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rlhf.data.batch import Batch
from rlhf.data.batch_split import BatchSplit
from rlhf.parallel.layout import Layout

_DISPATCH_ATTR = "_rlhf_dispatch"
_INLINE_TYPES = (type(None), bool, int, float, str, enum.Enum)  # cheap to send by value


class Dispatch(enum.Enum):
    """How a registered method's arguments reach the ranks and how results come back."""

    ONE_TO_ALL = "one_to_all"
    """Same arguments to every rank (put in the object store once); returns the list by rank."""
    ALL_TO_ALL = "all_to_all"
    """Every argument is a sequence with one element per rank; returns the list by rank."""
    RANK_ZERO = "rank_zero"
    """Only rank 0 runs the method; returns its result."""
    DP_COMPUTE = "dp_compute"
    """Batch arguments split over DP groups; results of each DP group's output rank, in DP order
    (Batches concatenated, so the driver's sample order comes back; other values as a list).
    With a `BatchSplit` argument, group g gets the rows `split.rows[g]` in that order and
    `split.groups[g]` in the split's place, and Batch results come back in the driver's order."""
    DP_COMPUTE_METRICS = "dp_compute_metrics"
    """As DP_COMPUTE, for methods returning {name: number}: the sample-weighted mean over DP
    groups (values a worker already all-reduced pass unchanged). A method may instead return
    (metrics, Batch): then (reduced metrics, Batches in the driver's order) comes back."""
    RANK_SPLIT = "rank_split"
    """Batch arguments split into one contiguous chunk per RANK, in rank order, whatever the
    layout (work each rank does alone, like sampling); results concatenated in rank order."""
    COLLECTIVE = "collective"
    """Same arguments to every rank (a collective method); returns rank 0's result, which the
    method makes the same on every rank (say, metrics reduced over the group)."""


def register(*, dispatch: Dispatch) -> Callable[[Callable], Callable]:
    """Mark a role method as callable from the driver through a WorkerGroup view."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"dispatch must be a Dispatch member, got {dispatch!r}")

    def mark(fn: Callable) -> Callable:
        setattr(fn, _DISPATCH_ATTR, dispatch)
        return fn

    return mark


def registered_methods(role_cls: type) -> dict[str, Dispatch]:
    """{method name: dispatch mode} of every `@register`ed method of `role_cls` (and its bases)."""
    found = {}
    for name in dir(role_cls):
        mode = getattr(getattr(role_cls, name, None), _DISPATCH_ATTR, None)
        if mode is not None:
            found[name] = mode
    return found


@dataclass
class CallRouting:
    """Per-rank arguments (None: the rank does not run) and which ranks send their result back."""

    args: list[tuple[tuple, dict] | None]
    keep: list[bool]
    weights: list[int] | None = None  # samples per DP group, for DP_COMPUTE_METRICS
    order: list[int] | None = None  # driver row of each concatenated result row (a BatchSplit)


def route_call(mode: Dispatch, layout: Layout, args: tuple, kwargs: dict) -> CallRouting:
    """Split driver arguments into per-rank arguments; object-store puts happen here."""
    n = layout.world_size
    if mode is Dispatch.ONE_TO_ALL:
        shared = _share_all(args, kwargs)
        return CallRouting([shared] * n, [True] * n)
    if mode is Dispatch.ALL_TO_ALL:
        return CallRouting(_scatter(args, kwargs, n), [True] * n)
    if mode is Dispatch.RANK_ZERO:
        return CallRouting([(args, kwargs)] + [None] * (n - 1), [True] + [False] * (n - 1))
    if mode is Dispatch.COLLECTIVE:
        return CallRouting([_share_all(args, kwargs)] * n, [True] + [False] * (n - 1))
    if mode is Dispatch.RANK_SPLIT:
        per_rank, weights, _ = _split_dp(args, kwargs, n, with_split=False)
        return CallRouting(per_rank, [True] * n, weights)
    per_dp, weights, order = _split_dp(args, kwargs, layout.dp, with_split=True)
    outputs = set(layout.output_ranks())
    return CallRouting(
        [per_dp[layout.coordinate(r)[0]] for r in range(n)],
        [r in outputs for r in range(n)],
        weights,
        order,
    )


def collect(mode: Dispatch, layout: Layout, routing: CallRouting, results: Mapping[int, Any]) -> Any:
    """One value from the results of the ranks that `routing` keeps ({rank: result})."""
    if mode in (Dispatch.ONE_TO_ALL, Dispatch.ALL_TO_ALL):
        return [results[r] for r in range(layout.world_size)]
    if mode in (Dispatch.RANK_ZERO, Dispatch.COLLECTIVE):
        return results[0]
    if mode is Dispatch.RANK_SPLIT:
        per_dp = [results[r] for r in range(layout.world_size)]
    else:
        per_dp = [results[r] for r in layout.output_ranks()]
    if mode is Dispatch.DP_COMPUTE_METRICS:
        if all(isinstance(x, tuple) and len(x) == 2 for x in per_dp):
            return (reduce_metrics([m for m, _ in per_dp], routing.weights),
                    _in_driver_order([b for _, b in per_dp], routing.order))
        return reduce_metrics(per_dp, routing.weights)
    if all(isinstance(x, Batch) for x in per_dp):
        return _in_driver_order(per_dp, routing.order)
    if all(x is None for x in per_dp):
        return None
    return per_dp


def _in_driver_order(per_dp: Sequence[Batch], order: Sequence[int] | None) -> Batch:
    """Concatenated results; with a routing's `order` (driver row of each concatenated row), put
    back so that row i is the driver's row i."""
    out = Batch.concat(per_dp)
    if order is None:
        return out
    if len(out) != len(order):
        raise ValueError(f"the DP groups returned {len(out)} rows for the {len(order)} rows the "
                         "plan sent them; a planned method must return one row per row it got")
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return out.select(inverse)


def reduce_metrics(per_dp: Sequence[Mapping[str, Any]], weights: Sequence[int] | None) -> dict:
    """Mean of each metric over DP groups weighted by their sample counts.

    Values a worker already reduced over its DP group (the same on every rank) pass unchanged.
    """
    for i, m in enumerate(per_dp):
        if not isinstance(m, Mapping):
            raise TypeError(f"DP_COMPUTE_METRICS: DP group {i} returned a {type(m).__name__}, "
                            "not a dict of numbers; use DP_COMPUTE for other results")
        if set(m) != set(per_dp[0]):
            raise ValueError(f"DP_COMPUTE_METRICS: DP group {i} returned keys {sorted(m)} but "
                             f"group 0 returned {sorted(per_dp[0])}; every group needs the same "
                             "keys")
    w = list(weights) if weights and sum(weights) > 0 else [1] * len(per_dp)
    total = sum(w)
    out = {}
    for key in per_dp[0]:
        values = [_as_number(key, m[key]) for m in per_dp]
        out[key] = sum(v * wi for v, wi in zip(values, w)) / total
    return out


def _as_number(key: str, value: Any) -> float:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()  # 0-dim tensors and numpy scalars
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"DP_COMPUTE_METRICS: metric '{key}' is a {type(value).__name__}, "
                        "not a number; return scalars only")
    return float(value)


def _share(value: Any) -> Any:
    # One object-store copy, however many ranks read it; small plain values travel inline.
    if isinstance(value, (ray.ObjectRef, *_INLINE_TYPES)):
        return value
    return ray.put(value)


def _share_all(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(_share(a) for a in args), {k: _share(v) for k, v in kwargs.items()}


def _scatter(args: tuple, kwargs: dict, n: int) -> list[tuple[tuple, dict]]:
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != n:
            got = len(value) if isinstance(value, Sequence) else type(value).__name__
            raise ValueError(f"ALL_TO_ALL: {name} must be a list with one element per rank "
                             f"({n}), got {got}")
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(n)]


def _split_dp(args: tuple, kwargs: dict, dp: int, *,
              with_split: bool) -> tuple[list[tuple[tuple, dict]], list[int], list[int] | None]:
    """Per DP rank (args, kwargs): Batch arguments chunked (one put per chunk), others shared;
    the chunk sizes; and, with a BatchSplit argument (`with_split` modes only), the rows it sends
    each group instead of contiguous chunks, and its driver order."""
    batches = [a for a in (*args, *kwargs.values()) if isinstance(a, Batch)]
    if not batches:
        raise TypeError("DP_COMPUTE and RANK_SPLIT need at least one Batch argument to split; "
                        "use ONE_TO_ALL for methods that take no Batch")
    batch_splits = [a for a in (*args, *kwargs.values()) if isinstance(a, BatchSplit)]
    batch_split = _check_split(batch_splits, batches, dp) if with_split else None
    if batch_splits and not with_split:
        raise TypeError("a BatchSplit argument is only for DP_COMPUTE and DP_COMPUTE_METRICS "
                        "methods")

    def split(value: Any) -> list[Any]:
        if isinstance(value, Batch):
            if batch_split is not None:
                return [ray.put(value.select(list(rows))) for rows in batch_split.rows]
            return [ray.put(chunk) for chunk in value.chunk(dp)]
        if isinstance(value, BatchSplit):
            return list(value.groups)  # small: index lists, sent by value
        return [_share(value)] * dp

    split_args = [split(a) for a in args]
    split_kwargs = {k: split(v) for k, v in kwargs.items()}
    per_dp = [
        (tuple(a[d] for a in split_args), {k: v[d] for k, v in split_kwargs.items()})
        for d in range(dp)
    ]
    if batch_split is not None:
        return per_dp, [len(r) for r in batch_split.rows], [i for rows in batch_split.rows for i in rows]
    weights = [len(c) for c in batches[0].chunk(dp)]  # chunk is a cheap view: sizes only
    return per_dp, weights, None


def _check_split(splits: list[BatchSplit], batches: list[Batch], dp: int) -> BatchSplit | None:
    if not splits:
        return None
    if len(splits) > 1:
        raise TypeError(f"a call takes at most one BatchSplit argument, got {len(splits)}")
    split = splits[0]
    if split.dp != dp:
        raise ValueError(f"the BatchSplit is for {split.dp} DP groups but the role has {dp}; split "
                         f"with dp=view.layout.dp ({dp})")
    for b in batches:
        if len(b) != split.num_samples:
            raise ValueError(f"the BatchSplit covers {split.num_samples} samples but a Batch "
                             f"argument has {len(b)}; split the batch you send")
    return split
