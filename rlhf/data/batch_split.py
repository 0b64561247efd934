"""The driver's batch split of one role call: which rows each data-parallel group gets, in which
mini-batches and micro-batches.

The driver sees every sample, so it splits (workers only execute):
    mini-batch k = driver rows [k * mini_size, (k + 1) * mini_size), whatever the DP size, so
    every optimizer step sees the same samples at dp 1, 2, 4;
    within it, samples are balanced over DP groups by cost (Karmarkar-Karp, `balancing.py`) and
    packed into micro-batches under the token budget, every group getting the same count
    (empty ones dropped, or kept at ep > 1, where every rank must run each exchange).
    With shared prompts (`shared`, rlhf.data.packing.shared_prompt_lens) the units balanced and
    packed are runs of one prompt's samples, counted at the tokens they pack to (the prompt
    once), so they land in one micro-batch and hold the prompt once; a run that would pass the
    budget is cut into pieces that fit.
A `BatchSplit` is small and picklable (index lists and token counts). The dispatcher hands
DP group g the rows `split.rows[g]` in that order with `split.groups[g]`, whose index lists
point into those rows, and maps results back to the driver's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlhf.data.balancing import assign_micro_batches, check_lengths
from rlhf.data.cost_model import Shape
from rlhf.data.micro_batching import CostPlan, faster_plan, plan_by_cost


@dataclass(frozen=True)
class GroupBatches:
    """What one DP group runs on the rows it receives, in execution order."""

    mini_batches: tuple[tuple[tuple[int, ...], ...], ...]
    """[mini-batch][micro-batch] -> indices into the group's rows."""
    token_counts: tuple[tuple[int, ...], ...]
    """[mini-batch][micro-batch] -> packed tokens (prompt + response) of that micro-batch."""

    @property
    def num_rows(self) -> int:
        return sum(len(mb) for mini in self.mini_batches for mb in mini)


@dataclass(frozen=True)
class BatchSplit:
    """Per DP group, the driver rows it receives (in order) and the GroupBatches it executes."""

    rows: tuple[tuple[int, ...], ...]
    """[group] -> driver row indices, in the order the group receives them."""
    groups: tuple[GroupBatches, ...]
    group_costs: tuple[tuple[float, ...], ...]
    """[mini-batch][group] -> summed sample cost: what the balancing evens out (with a cost
    model: the group's predicted pass seconds)."""
    fallbacks: tuple[bool, ...] = ()
    """With a cost model, [mini-batch] -> True where it predicted the token budget's plan
    faster than its own and kept that one; () without."""

    @property
    def dp(self) -> int:
        return len(self.rows)

    @property
    def num_samples(self) -> int:
        return sum(len(r) for r in self.rows)

    @property
    def num_mini_batches(self) -> int:
        return len(self.group_costs)

    def mini_batch_rows(self, k: int) -> list[int]:
        """Driver rows of mini-batch k over all groups (sorted): the samples of step k."""
        return sorted(self.rows[g][i] for g, grp in enumerate(self.groups)
                      for mb in grp.mini_batches[k] for i in mb)

    @property
    def imbalance(self) -> float:
        """Worst mini-batch's max over mean group cost: 1.0 is perfect balance."""
        worst = 1.0
        for costs in self.group_costs:
            mean = sum(costs) / len(costs)
            if mean > 0:
                worst = max(worst, max(costs) / mean)
        return worst


def split_batch(lengths: Sequence[int], *, dp: int, max_tokens: int, mini_size: int | None = None,
                max_seqs: int | None = None, cost: Callable[[int], float] | None = None,
                what: str = "mini_size", shared: Sequence[int] | None = None,
                keep_empty: bool = False, cost_plan: CostPlan | None = None) -> BatchSplit:
    """Split samples of packed `lengths` over `dp` groups: consecutive mini-batches of
    `mini_size` samples (None: one mini-batch of all), each balanced over the groups and
    packed under `max_tokens` (and `max_seqs`) per micro-batch, or, with `cost_plan`, cut and
    ordered by the cost model (rlhf.data.micro_batching; each sample still within
    `max_tokens`), unless it predicts the token budget's plan faster. `what` names `mini_size` in
    errors (say, "actor.ppo_mini_batch_size * rollout.n"). `shared[i]`: prompt tokens sample
    i reads from the first sample of its run (packing's shared prompts); not with `max_seqs`,
    which counts samples, so a sample cap splits sample by sample (packing still shares).
    `keep_empty`: a group with fewer samples than micro-batches keeps empty ones, so every
    group runs as many (expert parallelism: the ranks of an ep group exchange tokens in every
    micro-batch); otherwise they are dropped."""
    n = len(lengths)
    check_lengths(lengths, max_tokens)
    size = n if mini_size is None else mini_size
    if mini_size is not None and (size < 1 or n % size or n == 0):
        raise ValueError(f"{n} samples do not split into mini-batches of {what} = {size}; "
                         f"send a multiple of {max(size, 1)} samples")
    rows: list[list[int]] = [[] for _ in range(dp)]
    minis: list[list[list[tuple[int, ...]]]] = [[] for _ in range(dp)]
    tokens: list[list[list[int]]] = [[] for _ in range(dp)]
    costs, fallbacks = [], []
    for start in range(0, n, size) if n else [0]:
        units = share_units(lengths[start:start + size],
                            shared[start:start + size] if shared and max_seqs is None else None,
                            max_tokens)
        sub = assign_micro_batches([tokens for _, tokens in units], dp=dp,
                                   max_tokens=max_tokens, max_seqs=max_seqs, cost=cost)
        if cost_plan is not None:
            shapes = [unit_shape(samples, tokens, lengths[start:start + size])
                      for samples, tokens in units]
            sub, fell_back = faster_plan(plan_by_cost(shapes, dp=dp, plan=cost_plan,
                                                      max_seqs=max_seqs), sub, shapes, cost_plan)
            fallbacks.append(fell_back)
        costs.append(sub.rank_costs)
        for g in range(dp):
            mbs, counts = [], []
            for mb, count in zip(sub.rank(g), sub.token_counts[g]):
                if mb or keep_empty:  # empty only when a group has fewer samples than mbs
                    samples = sorted(i for u in mb for i in units[u][0])
                    mbs.append(tuple(range(len(rows[g]), len(rows[g]) + len(samples))))
                    rows[g].extend(start + i for i in samples)
                    counts.append(count)
            minis[g].append(mbs)
            tokens[g].append(counts)
    groups = tuple(GroupBatches(tuple(tuple(m) for m in minis[g]), tuple(tuple(c) for c in tokens[g]))
                   for g in range(dp))
    return BatchSplit(tuple(tuple(r) for r in rows), groups, tuple(costs), tuple(fallbacks))


def share_units(lengths: Sequence[int], shared: Sequence[int] | None,
                max_tokens: int) -> list[tuple[tuple[int, ...], int]]:
    """(samples, packed tokens) of each balancing unit: a run of samples that share a prompt
    (`shared[i]` > 0: sample i continues the run before it), cut where the next sample would
    pass `max_tokens` (it then starts a unit of its own, holding the whole prompt); one unit
    per sample without `shared`."""
    units: list[tuple[tuple[int, ...], int]] = []
    for i, n in enumerate(lengths):
        saved = shared[i] if shared is not None else 0
        if saved and units and units[-1][1] + n - saved <= max_tokens:
            samples, tokens = units[-1]
            units[-1] = (samples + (i,), tokens + n - saved)
        else:
            units.append(((i,), n))
    return units


def unit_shape(samples: Sequence[int], tokens: int, lengths: Sequence[int]) -> Shape:
    """The cost model's shape of a balancing unit: its packed tokens, and its samples' count
    and (squared) lengths, each attending over its prompt and response."""
    return Shape(tokens, len(samples), sum(lengths[i] ** 2 for i in samples),
                 max(lengths[i] ** 2 for i in samples))


def role_budget(role) -> tuple[int, int | None]:
    """(max_tokens, max_seqs) per micro-batch of a role config: its
    `max_tokens_per_micro_batch` and, for a training role, its `micro_batch_size`."""
    return role.max_tokens_per_micro_batch, getattr(role, "micro_batch_size", None)


def split_role_batch(lengths: Sequence[int], role, *, dp: int, mini_size: int | None = None,
                     what: str = "mini_size", shared: Sequence[int] | None = None,
                     cost_plan: CostPlan | None = None) -> BatchSplit:
    """`split_batch` under a role config's budget (`role_budget`); `shared` (the batch's
    shared_prompt_lens) is used when the role shares prompts (`share_prompts`); empty
    micro-batches are kept at ep > 1; `cost_plan`: cut by the cost model (see `split_batch`)."""
    max_tokens, max_seqs = role_budget(role)
    return split_batch(lengths, dp=dp, max_tokens=max_tokens, max_seqs=max_seqs,
                       mini_size=mini_size, what=what,
                       shared=shared if role.share_prompts else None,
                       keep_empty=role.parallel.ep > 1, cost_plan=cost_plan)
