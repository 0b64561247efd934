"""Micro-batches planned by a measured cost model (DynaPipe): `trainer.micro_batching: cost_model`.

Per mini-batch, on the driver, for one role's pass:
1. balance the samples over DP ranks by their predicted time (`PhaseCost.marginal_time`, in
   place of token_budget's analytic `balancing.default_cost`);
2. per rank, cut the length-sorted samples into contiguous micro-batches by dynamic
   programming (`optimal_cut`), minimising the predicted pass time
   sum_j t_j + (pp - 1) * max_j t_j (t_j: the slowest stage's time on micro-batch j plus its
   p2p messages; the second term is the pipeline's fill and drain), each micro-batch under the
   memory limit;
3. with pp > 1, order the micro-batches by simulating the role's schedule (1F1B or
   interleaved, the orders of rlhf.engine.pipeline_order) on the predicted stage times
   (`simulate_pipeline`) for each candidate order and keeping the fastest.
Pure and deterministic: the same lengths give the same plan on any machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlhf.data.balancing import MicroBatchAssignment, balanced_partition
from rlhf.data.cost_model import PhaseCost, Shape

# An order step as rlhf.engine.pipeline_order writes it: (kind "F"/"B", micro-batch, chunk).
StepTuple = tuple[str, int, int]
OrdersFor = Callable[[int], Sequence[Sequence[StepTuple]]]
# Candidate thresholds on the largest micro-batch time the pipeline objective tries (all of
# them, exactly, when there are no more distinct values than this).
MAX_THRESHOLDS = 64
ORDERS = ("small_large_small", "ascending", "descending")


@dataclass(frozen=True)
class CostPlan:
    """What the planner needs of a role's pass: its phase cost, the memory limit of one
    micro-batch, its pipeline (pp, vpp) and the schedule's step orders (`orders_for(m)`, one
    order per pipeline rank; None at pp = 1); `forward`: the forward phase's cost, to split a
    forward_backward stage time into its forward and backward steps when simulating."""

    phase: PhaseCost
    memory_limit: float
    pp: int = 1
    vpp: int = 1
    orders_for: OrdersFor | None = None
    forward: PhaseCost | None = None
    margin: float = 0.0
    """A predicted gain over the token budget's plan below this share of its time is not
    trusted (the profile's median fit error on its grid): that plan is kept instead."""

    def micro_batch_cost(self, shape: Shape) -> float:
        """What one more micro-batch of `shape` adds to the pass: its slowest stage, and its
        messages between stages (in, and for a backward also out) on the critical path."""
        messages = 1 if self.forward is self.phase else 2
        return self.phase.bottleneck(shape) + messages * self.phase.p2p_time(shape)


def memory_limit(phase: PhaseCost, max_tokens: int) -> float:
    """The predicted peak of the largest micro-batch the token budget allows (one sequence of
    `max_tokens`): the cost model packs more tokens only where it predicts no more memory."""
    return phase.memory(Shape.of([max_tokens]))


def optimal_cut(shapes: Sequence[Shape], cost: Callable[[Shape], float], *,
                fits: Callable[[Shape], bool], pp: int = 1, max_seqs: int | None = None,
                evaluate: Callable[[list[tuple[int, int]]], float] | None = None
                ) -> list[tuple[int, int]]:
    """Contiguous segments [i, j) of `shapes` (sorted by length) minimising
    sum cost + (pp - 1) * max cost, each fitting (`fits`, at most `max_seqs` items); at
    pp > 1 `evaluate(cut)`, if given, ranks the candidate cuts instead (a simulated schedule)."""
    n = len(shapes)
    if n == 0:
        return []
    # segments[j]: (i, cost of [i, j)) of every feasible segment ending at j; growing it to the
    # left only adds work and memory (non-negative coefficients), so the first misfit stops it.
    segments: list[list[tuple[int, float]]] = [[] for _ in range(n + 1)]
    for j in range(1, n + 1):
        shape = Shape(0, 0, 0, 0)
        for i in range(j - 1, -1, -1):
            shape = shape + shapes[i]
            if (max_seqs is not None and j - i > max_seqs) or not fits(shape):
                break
            segments[j].append((i, cost(shape)))
        if not segments[j]:
            raise ValueError(f"sample {j - 1} alone exceeds the micro-batch memory limit; raise "
                             "max_tokens_per_micro_batch or shorten the sequence")
    if pp == 1:
        return _best_sum(segments, n, float("inf"))[1]
    floor = max(_single(segments, j) for j in range(1, n + 1))  # no cut's max is below it
    values = sorted({c for segs in segments for _, c in segs if c >= floor})
    if len(values) > MAX_THRESHOLDS:
        step = (len(values) - 1) / (MAX_THRESHOLDS - 1)
        values = sorted({values[round(k * step)] for k in range(MAX_THRESHOLDS)})
    best: tuple[float, list[tuple[int, int]]] | None = None
    for tau in values:
        total, cut = _best_sum(segments, n, tau)
        if not cut:
            continue
        objective = (evaluate(cut) if evaluate is not None
                     else total + (pp - 1) * max(_costs(segments, cut)))
        if best is None or objective < best[0] - 1e-15:
            best = (objective, cut)
    assert best is not None  # tau = the largest value admits every feasible cut
    return best[1]


def _single(segments: list[list[tuple[int, float]]], j: int) -> float:
    """The cost of item j - 1 alone: a lower bound on the largest segment of any cut."""
    return segments[j][0][1]


def _costs(segments, cut: list[tuple[int, int]]) -> list[float]:
    return [next(c for i, c in segments[j] if i == start) for start, j in cut]


def _best_sum(segments, n: int, tau: float) -> tuple[float, list[tuple[int, int]]]:
    """Least summed cost of a cut of [0, n) into feasible segments each of cost <= tau."""
    inf = float("inf")
    best = [0.0] + [inf] * n
    back = [-1] * (n + 1)
    for j in range(1, n + 1):
        for i, c in segments[j]:
            if c > tau:
                break  # costs only grow as the segment grows to the left
            if best[i] + c < best[j]:
                best[j], back[j] = best[i] + c, i
    if best[n] == inf:
        return inf, []
    cut, j = [], n
    while j > 0:
        cut.append((back[j], j))
        j = back[j]
    return best[n], cut[::-1]


def pass_time(times: Sequence[float], pp: int) -> float:
    """The objective `optimal_cut` minimises, for micro-batches of these bottleneck times."""
    return sum(times) + (pp - 1) * max(times, default=0.0)


def simulate_pipeline(orders: Sequence[Sequence[StepTuple]], *, forward: Sequence[Sequence[float]],
                      backward: Sequence[Sequence[float]], p2p: Sequence[float], pp: int) -> float:
    """Seconds until every rank has run its order: a step starts when its rank is free and its
    input (the previous virtual stage's activation, or the next one's gradient) has arrived,
    `p2p[i]` after it was made. `forward[i][v]`, `backward[i][v]`: micro-batch i on virtual
    stage v (chunk * pp + rank). Inf when the orders wait on each other forever."""
    last = len(forward[0]) - 1 if forward else 0
    done: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * pp, [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, i, chunk = orders[r][pos[r]]
                v = chunk * pp + r
                dep = (("F", i, v - 1) if v > 0 else None) if kind == "F" else (
                    ("B", i, v + 1) if v < last else None)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] + p2p[i] if dep is not None else 0.0)
                clock[r] = start + (forward if kind == "F" else backward)[i][v]
                done[(kind, i, v)] = clock[r]
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            return float("inf")
    return max(clock)


def ordered(bins: list[list[int]], times: Sequence[float], how: str) -> list[int]:
    """Indices of `bins` in the order `how` (one of ORDERS) by their `times`."""
    ranked = sorted(range(len(bins)), key=lambda k: (times[k], bins[k]))
    if how == "ascending":
        return ranked
    if how == "descending":
        return ranked[::-1]
    return ranked[0::2] + ranked[1::2][::-1]  # cheap ones where the pipeline fills and drains


def choose_order(bins: list[list[int]], shapes: Sequence[Shape], plan: CostPlan
                 ) -> tuple[list[int], float]:
    """(the order of `bins` the simulated schedule runs fastest, its predicted seconds); the
    small-large-small order at pp = 1, where the order does not matter."""
    mb_shapes = [_sum_shapes(shapes[i] for i in b) for b in bins]
    times = [plan.phase.bottleneck(s) for s in mb_shapes]
    candidates = ORDERS if plan.pp > 1 and plan.orders_for is not None else ORDERS[:1]
    best: tuple[float, list[int]] | None = None
    for how in candidates:
        order = ordered(bins, times, how)
        seconds = predict_pass(plan, [mb_shapes[k] for k in order])
        if best is None or seconds < best[0] - 1e-12:
            best = (seconds, order)
    assert best is not None
    return best[1], best[0]


def predict_pass(plan: CostPlan, shapes: Sequence[Shape]) -> float:
    """Predicted seconds of a pass over micro-batches of these shapes in this order: the
    simulated schedule at pp > 1, the sum of their times at pp = 1."""
    if plan.pp == 1 or plan.orders_for is None or not shapes:
        return pass_time([plan.phase.bottleneck(s) for s in shapes], plan.pp)
    fwd, bwd, p2p = _step_times(plan, shapes)
    return simulate_pipeline(plan.orders_for(len(shapes)), forward=fwd, backward=bwd, p2p=p2p,
                             pp=plan.pp)


def _step_times(plan: CostPlan, shapes: Sequence[Shape]):
    """Per micro-batch and virtual stage, (forward, backward) seconds, and the p2p seconds."""
    fwd, bwd = [], []
    for shape in shapes:
        total = plan.phase.stage_times(shape)
        if plan.forward is not None and plan.forward is not plan.phase:
            first = [min(f, t) for f, t in zip(plan.forward.stage_times(shape), total)]
        elif plan.forward is plan.phase:
            first = total  # a forward-only pass
        else:
            first = [t / 3 for t in total]  # backward ~ twice the forward's matmuls
        per_f = [first[v % plan.pp] / plan.vpp for v in range(plan.pp * plan.vpp)]
        per_b = [(total[v % plan.pp] - first[v % plan.pp]) / plan.vpp
                 for v in range(plan.pp * plan.vpp)]
        fwd.append(per_f)
        bwd.append(per_b)
    return fwd, bwd, [plan.phase.p2p_time(s) for s in shapes]


def _sum_shapes(shapes) -> Shape:
    total = Shape(0, 0, 0, 0)
    for s in shapes:
        total = total + s
    return total


def plan_by_cost(shapes: Sequence[Shape], *, dp: int, plan: CostPlan,
                 max_seqs: int | None = None) -> MicroBatchAssignment:
    """Units of these shapes over `dp` ranks, cut and ordered by the cost model (module doc).
    `rank_costs` are the predicted pass seconds of each rank."""
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    parts = balanced_partition([plan.phase.marginal_time(s) for s in shapes], dp)
    micro, seconds = [], []
    for part in parts:
        ids = sorted(part, key=lambda i: (shapes[i].tokens, shapes[i].sum_sq, i))

        def bins_of(cut, ids=ids):
            return [sorted(ids[a:b]) for a, b in cut]
        # The closed form misses the schedule's waits and messages: with a pipeline, each
        # candidate cut is ranked by its simulated pass in its best order.
        simulated = ((lambda cut: choose_order(bins_of(cut), shapes, plan)[1])
                     if plan.pp > 1 and plan.orders_for is not None else None)
        cut = optimal_cut([shapes[i] for i in ids], plan.micro_batch_cost, pp=plan.pp,
                          fits=lambda s: plan.phase.memory(s) <= plan.memory_limit,
                          max_seqs=max_seqs, evaluate=simulated)
        bins = bins_of(cut)
        order, predicted = choose_order(bins, shapes, plan)
        micro.append(tuple(tuple(bins[k]) for k in order))
        seconds.append(predicted)
    counts = tuple(tuple(sum(shapes[i].tokens for i in mb) for mb in r) for r in micro)
    return MicroBatchAssignment(micro_batches=tuple(micro), token_counts=counts,
                                rank_costs=tuple(seconds),
                                max_tokens=max((c for r in counts for c in r), default=0),
                                has_empty_micro_batches=False)


def predicted_passes(assignment: MicroBatchAssignment, shapes: Sequence[Shape],
                     plan: CostPlan) -> tuple[float, ...]:
    """Each rank's predicted pass over its micro-batches as they stand (empty ones skipped)."""
    return tuple(predict_pass(plan, [_sum_shapes(shapes[i] for i in mb) for mb in rank if mb])
                 for rank in assignment.micro_batches)


def faster_plan(planned: MicroBatchAssignment, baseline: MicroBatchAssignment,
                shapes: Sequence[Shape], plan: CostPlan) -> tuple[MicroBatchAssignment, bool]:
    """The cost model's plan, or the token budget's `baseline` (True) unless the cost model
    predicts its own slowest rank faster by more than `plan.margin`; `rank_costs` the
    predicted passes either way."""
    base = predicted_passes(baseline, shapes, plan)
    if max(planned.rank_costs, default=0.0) <= (1 - plan.margin) * max(base, default=0.0):
        return planned, False
    return dataclasses.replace(baseline, rank_costs=base), True
