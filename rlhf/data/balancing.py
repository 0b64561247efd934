"""Micro-batch assignment: which samples each data-parallel rank runs, in which micro-batch, in what order.

Pure bookkeeping on sample lengths, no tensors and no communication: the driver computes one
`MicroBatchAssignment` and sends the same object to every rank and pipeline stage, so each of them
knows every micro-batch's packed token count (hence every send/recv shape) before it starts.

Steps: balance per-sample cost across DP ranks (Karmarkar-Karp, checked against LPT, then a
move/swap polish), pack each rank's samples under the token budget (first-fit decreasing),
split micro-batches until every rank has the same count, order them small-large-small.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Length at which a sequence's attention work equals its linear-layer work. Per token, a dense
# transformer spends ~24*h^2 FLOPs in projections and MLP and ~4*l*h on attention scores, so the
# two match at l ~ 6*h; 16384 fits h ~ 2.7k. Pass `cost=` to match another model.
ATTENTION_CROSSOVER = 16384


def default_cost(length: int) -> float:
    """Work of one sequence: linear in tokens plus an attention term quadratic in its length."""
    return length + length * length / ATTENTION_CROSSOVER


@dataclass(frozen=True)
class MicroBatchAssignment:
    """Per DP rank, equally many micro-batches of sample indices, with their packed token counts."""

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    """[rank][micro-batch] -> sample indices (ascending) packed into that micro-batch."""
    token_counts: tuple[tuple[int, ...], ...]
    """[rank][micro-batch] -> packed tokens, the sum of its samples' lengths."""
    rank_costs: tuple[float, ...]
    """[rank] -> summed cost of the rank's samples."""
    max_tokens: int
    """Token budget every micro-batch respects."""
    has_empty_micro_batches: bool
    """True only when some rank has fewer samples than the common micro-batch count."""

    @property
    def dp(self) -> int:
        return len(self.micro_batches)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank, the same on every rank."""
        return len(self.micro_batches[0]) if self.micro_batches else 0

    def rank(self, i: int) -> tuple[tuple[int, ...], ...]:
        """The micro-batches of DP rank `i`, in execution order."""
        return self.micro_batches[i]

    @property
    def num_samples(self) -> int:
        return sum(len(mb) for r in self.micro_batches for mb in r)

    @property
    def total_tokens(self) -> int:
        return sum(sum(r) for r in self.token_counts)

    @property
    def max_rank_cost(self) -> float:
        return max(self.rank_costs, default=0.0)

    @property
    def imbalance(self) -> float:
        """Max over mean rank cost: 1.0 is perfect; the step waits on the slowest rank."""
        mean = sum(self.rank_costs) / max(len(self.rank_costs), 1)
        return self.max_rank_cost / mean if mean > 0 else 1.0


def assign_micro_batches(lengths: Sequence[int], *, dp: int, max_tokens: int,
                         cost: Callable[[int], float] | None = None, max_seqs: int | None = None,
                         min_micro_batches: int = 0) -> MicroBatchAssignment:
    """Split samples (packed lengths, prompt + response) over `dp` ranks into micro-batches of at
    most `max_tokens` tokens (and `max_seqs` samples), balancing `cost` (default `default_cost`)
    across ranks; at least `min_micro_batches` per rank (to match other ranks' count)."""
    lengths = [int(n) for n in lengths]
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    check_lengths(lengths, max_tokens)
    cost = cost or default_cost
    costs = [float(cost(n)) for n in lengths]
    parts = balanced_partition(costs, dp)
    packed = [_first_fit_decreasing(p, lengths, max_tokens, max_seqs) for p in parts]
    target = max(max((len(mbs) for mbs in packed), default=0), min_micro_batches)
    packed = [_split_to_count(mbs, target, lengths) for mbs in packed]
    ordered = [_small_large_small(mbs, costs) for mbs in packed]
    return MicroBatchAssignment(
        micro_batches=tuple(tuple(tuple(mb) for mb in mbs) for mbs in ordered),
        token_counts=tuple(tuple(sum(lengths[i] for i in mb) for mb in mbs) for mbs in ordered),
        rank_costs=tuple(sum(costs[i] for i in p) for p in parts),
        max_tokens=max_tokens,
        has_empty_micro_batches=any(not mb for mbs in ordered for mb in mbs))


def check_lengths(lengths: Sequence[int], max_tokens: int) -> None:
    """ValueError unless every sample fits a micro-batch of `max_tokens` tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"sample {i} has negative length {n}")
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens but a micro-batch holds at most "
                             f"max_tokens={max_tokens}; raise the budget to at least {n} or "
                             "shorten the sequence")


def balanced_partition(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Indices split into `parts` groups with near-equal summed cost: the better of Karmarkar-Karp
    and LPT (so never worse than either), then polished by single moves and swaps."""
    kk, lpt = karmarkar_karp(costs, parts), lpt_partition(costs, parts)
    best = min((kk, lpt), key=lambda p: _max_sum(p, costs))  # ties keep KK
    return _polish(best, costs)


def karmarkar_karp(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Largest differencing method for `parts` groups, heaviest group first.

    Each sample starts as a `parts`-tuple (itself plus empty groups). Repeatedly merge the two
    tuples with the largest spread (max - min), joining one's heaviest group with the other's
    lightest, which cancels most of both spreads.
    """
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap, tie = [], 0  # entries (-spread, tie, groups); groups: list of (sum, indices) heaviest first
    for i in order:
        groups = [(costs[i], [i])] + [(0.0, []) for _ in range(parts - 1)]
        heap.append((-costs[i], tie, groups))
        tie += 1
    heapq.heapify(heap)
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda g: -g[0])  # stable: deterministic among equal sums
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tie, merged))
        tie += 1
    return [sorted(ids) for _, ids in heap[0][2]]


def lpt_partition(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Longest processing time first: each sample, heaviest first, joins the lightest group."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0.0, g) for g in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        total, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (total + costs[i], g))
    return [sorted(g) for g in groups]


def _max_sum(groups: list[list[int]], costs: Sequence[float]) -> float:
    return max(sum(costs[i] for i in g) for g in groups)


def _polish(groups: list[list[int]], costs: Sequence[float], max_rounds: int = 256) -> list[list[int]]:
    """Lower the heaviest group by the single move or swap with another group that helps most."""
    groups = [list(g) for g in groups]
    for _ in range(max_rounds):
        sums = [sum(costs[i] for i in g) for g in groups]
        h = max(range(len(groups)), key=lambda g: (sums[g], -g))
        best = None  # (new max of the pair, r, a, b-or-None)
        for r in range(len(groups)):
            gap = sums[h] - sums[r]
            if r == h or gap <= 0:
                continue
            for a in groups[h]:
                for b in [None, *groups[r]]:
                    d = costs[a] - (costs[b] if b is not None else 0.0)
                    if 0 < d < gap and (best is None or max(sums[h] - d, sums[r] + d) < best[0]):
                        best = (max(sums[h] - d, sums[r] + d), r, a, b)
        if best is None or best[0] >= sums[h] * (1 - 1e-12):
            break
        _, r, a, b = best
        groups[h].remove(a)
        groups[r].append(a)
        if b is not None:
            groups[r].remove(b)
            groups[h].append(b)
    return [sorted(g) for g in groups]


def _first_fit_decreasing(ids: Sequence[int], lengths: Sequence[int], max_tokens: int,
                          max_seqs: int | None = None) -> list[list[int]]:
    """Longest sample first, each into the first micro-batch with room: few, well-filled bins."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(ids, key=lambda i: (-lengths[i], i)):
        for b in range(len(bins)):
            if used[b] + lengths[i] <= max_tokens and (max_seqs is None
                                                       or len(bins[b]) < max_seqs):
                bins[b].append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return bins


def _split_to_count(bins: list[list[int]], target: int, lengths: Sequence[int]) -> list[list[int]]:
    """Split the largest splittable micro-batch in two until there are `target`; pad with empty
    micro-batches only when every one already holds a single sample."""
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [k for k in range(len(bins)) if len(bins[k]) > 1]
        if not splittable:
            bins.append([])
            continue
        k = max(splittable, key=lambda k: (sum(lengths[i] for i in bins[k]), -k))
        halves: tuple[list[int], list[int]] = ([], [])
        sums = [0, 0]
        for i in sorted(bins[k], key=lambda i: (-lengths[i], i)):
            # Lighter half first, fewer samples on ties: both halves end up non-empty.
            side = 0 if (sums[0], len(halves[0])) <= (sums[1], len(halves[1])) else 1
            halves[side].append(i)
            sums[side] += lengths[i]
        bins[k:k + 1] = list(halves)
    return bins


def _small_large_small(bins: list[list[int]], costs: Sequence[float]) -> list[list[int]]:
    """Cheapest micro-batches at both ends, the most expensive in the middle (index count // 2).

    A pipeline fills with its first micro-batches and drains with its last; meanwhile only some
    stages work, so the bubble scales with the time of those edge micro-batches. Cheap ones there
    shorten fill and drain, and the steady state in the middle hides the expensive ones.
    """
    ranked = sorted((sorted(b) for b in bins), key=lambda b: (sum(costs[i] for i in b), b))
    return ranked[0::2] + ranked[1::2][::-1]
