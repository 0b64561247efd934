"""DAPO's dynamic sampling on the driver: generate and score, drop the prompt groups without
reward spread (rlhf.algorithms.group_filters), and draw fresh prompts until the batch holds
data.train_batch_size groups or algorithm.max_sampling_rounds rounds are spent.

Every round takes a full batch from the prompt loader, so the loader's position (saved in
checkpoints) counts every prompt consumed and a resumed run draws the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from rlhf.algorithms.group_filters import get_group_filter
from rlhf.config import JobConfig
from rlhf.data.batch import Batch

# (prompts) -> (samples, scores_N, metrics): one round's generation and scoring.
SampleFn = Callable[[Batch], "tuple[Batch, Tensor, dict[str, float]]"]


def round_seed(seed: int, round_index: int) -> int:
    """The sampling seed of one round of a step: round 0 keeps the step's seed (so a step
    samples as without dynamic sampling), later rounds get seeds mixed from (seed, round)."""
    if round_index == 0:
        return seed
    return int(np.random.SeedSequence([seed, round_index]).generate_state(1)[0]) % 2**31


def _without_meta(batch: Batch) -> Batch:
    return Batch({k: batch[k] for k in batch.keys()})  # rounds' seeds would clash on concat


def fill_batch(draw: Callable[[int], Batch], sample: SampleFn,
               cfg: JobConfig) -> tuple[Batch, Tensor, dict[str, float]]:
    """(samples, scores_N, metrics) of one step. `draw(round)` gives that round's prompts;
    with algorithm.dynamic_sampling off this is one round, unfiltered.

    When the rounds run out first, the batch is topped up with dropped groups (their
    group-relative advantages are zero, so they add no policy gradient) to keep its size;
    ds/batch_groups counts the groups with a reward spread. Reward metrics are round 1's,
    an unfiltered sample of the policy."""
    algo, n = cfg.algorithm, cfg.rollout.n
    if algo.dynamic_sampling == "off":
        return sample(draw(0))
    keep_fn = get_group_filter(algo.dynamic_sampling)
    wanted = cfg.data.train_batch_size
    kept: list[tuple[Batch, Tensor]] = []
    dropped: list[tuple[Batch, Tensor]] = []
    num_kept = num_dropped = consumed = rounds = 0
    first_metrics: dict[str, float] = {}
    while rounds < algo.max_sampling_rounds and num_kept < wanted:
        prompts = draw(rounds)
        consumed += len(prompts)
        batch, scores_N, metrics = sample(prompts)
        first_metrics = first_metrics or metrics
        rounds += 1
        keep_N = keep_fn(scores_N, n, std_threshold=algo.dynamic_sampling_std).repeat_interleave(n)
        for part, select_N in ((kept, keep_N), (dropped, ~keep_N)):
            idx = select_N.nonzero().flatten()
            if idx.numel():
                part.append((_without_meta(batch).select(idx), scores_N[idx]))
        num_kept += int(keep_N.sum()) // n
        num_dropped += int((~keep_N).sum()) // n
    signal_groups = min(num_kept, wanted)
    parts = kept + dropped  # kept groups first; dropped ones only top up a short batch
    batch = Batch.concat([b for b, _ in parts]).select(torch.arange(wanted * n))
    scores_N = torch.cat([s for _, s in parts])[:wanted * n]
    metrics = {**first_metrics, "ds/groups_dropped": float(num_dropped), "ds/rounds": float(rounds),
               "ds/prompts_consumed": float(consumed), "ds/batch_groups": float(signal_groups)}
    return batch, scores_N, metrics
