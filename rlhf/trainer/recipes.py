"""The per-response recipes' glue on the driver: overlong shaping of the scores, the masks
and weights of the update (truncated responses, rollout.reject_band and token_band,
sequence-level TIS), and dynamic sampling (DAPO: rounds of generate-and-score until the batch
holds enough prompt groups with a reward spread). Their math lives in rlhf.algorithms
(overlong.py, rollout_correction.py, group_filters.py); `PPOTrainer` (rlhf/trainer/ppo.py) calls
these between its phases.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from rlhf.algorithms.group_filters import NO_FILTER, get_group_filter
from rlhf.algorithms.overlong import overlong_penalty, truncated
from rlhf.algorithms.rollout_correction import (
    keep_tokens_in_band,
    reject_outside_band,
    rollout_correction_metrics,
    seq_tis_weights,
)
from rlhf.config import JobConfig
from rlhf.data.batch import Batch
from rlhf.data.fields import MASK, SEQ_IS_WEIGHTS, response_mask
from rlhf.data.ragged import Ragged


def truncated_responses(batch: Batch, cfg: JobConfig, eos_token_id: int | None) -> Tensor:
    """(n,) bool: responses that max_new_tokens cut (full length, last token not EOS)."""
    responses = batch["response_ids"]
    lengths_N = responses.lengths
    last_idx_N = (responses.offsets[1:] - 1).clamp_min(0)
    last_N = (responses.values[last_idx_N] if responses.values.numel()
              else torch.zeros_like(lengths_N))
    return truncated(lengths_N, last_N, max_new_tokens=cfg.rollout.max_new_tokens,
                     eos_token_id=eos_token_id)


def shape_scores(batch: Batch, scores_N: Tensor, cfg: JobConfig,
                 eos_token_id: int | None) -> tuple[Tensor, dict[str, float]]:
    """Scores plus the soft overlong penalty (algorithm.overlong_buffer > 0), and the metrics
    overlong/truncated_frac (always) and overlong/penalty_mean (when the penalty is on)."""
    algo = cfg.algorithm
    metrics = {"overlong/truncated_frac":
               truncated_responses(batch, cfg, eos_token_id).float().mean().item()}
    if algo.overlong_buffer > 0:
        penalty_N = overlong_penalty(batch["response_ids"].lengths,
                                     max_new_tokens=cfg.rollout.max_new_tokens,
                                     buffer=algo.overlong_buffer, penalty=algo.overlong_penalty)
        scores_N = scores_N + penalty_N.to(scores_N.dtype)
        metrics["overlong/penalty_mean"] = penalty_N.mean().item()
    return scores_N, metrics


def rollout_corr_metrics(batch: Batch, cfg: JobConfig,
                         keep_N: Tensor | None = None) -> dict[str, float]:
    """rollout_corr/* (ESS, rejected fraction, sampler/trainer KL) when the batch has both
    rollout and old log-probs, else {}."""
    if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
        return {}
    old, mask = batch["old_log_probs"], response_mask(batch)
    return rollout_correction_metrics(old.values, batch["rollout_log_probs"].values,
                                      mask.values, old.offsets, cap=cfg.rollout.seq_tis_cap,
                                      keep_N=keep_N)


def prepare_update(batch: Batch, cfg: JobConfig,
                   eos_token_id: int | None) -> tuple[Batch, dict[str, float]]:
    """The batch the actor trains on: truncated responses masked (algorithm.mask_truncated),
    responses outside rollout.reject_band masked, tokens outside rollout.token_band masked, and
    `seq_is_weights` (rollout.seq_tis_cap); with the rollout_corr/* metrics of the batch as it
    came (when old log-probs exist)."""
    algo, rollout = cfg.algorithm, cfg.rollout
    mask = response_mask(batch)
    cu, keep_N, fields = mask.offsets, None, {}
    drop_N = torch.zeros(len(batch), dtype=torch.bool)
    keep_T = mask.values.clone()
    if algo.mask_truncated:
        drop_N |= truncated_responses(batch, cfg, eos_token_id)
    token_metrics = {}
    if rollout.corrects_on_driver:
        if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
            raise ValueError("rollout correction on the driver needs old_log_probs and "
                             "rollout_log_probs in the batch before the actor update")
        old_T, rollout_T = batch["old_log_probs"].values, batch["rollout_log_probs"].values
        if rollout.reject_band is not None:
            low, high = rollout.reject_band
            keep_N = reject_outside_band(old_T, rollout_T, mask.values, cu, low=low, high=high)
            drop_N |= ~keep_N
        if rollout.token_band is not None:
            low, high = rollout.token_band
            in_band_T = keep_tokens_in_band(old_T, rollout_T, low=low, high=high)
            valid = int(mask.values.sum())
            token_metrics["rollout_corr/token_masked_frac"] = (
                float((mask.values & ~in_band_T).sum()) / valid if valid else 0.0)
            keep_T &= in_band_T
        if rollout.seq_tis_cap is not None:
            w_N = seq_tis_weights(old_T, rollout_T, mask.values, cu, cap=rollout.seq_tis_cap)
            fields[SEQ_IS_WEIGHTS] = Ragged(w_N.float().repeat_interleave(mask.lengths), cu)
    metrics = {**rollout_corr_metrics(batch, cfg, keep_N), **token_metrics}
    keep_T &= ~drop_N.repeat_interleave(mask.lengths)
    if not bool(keep_T.equal(mask.values)):
        fields[MASK] = Ragged(keep_T, cu)
        if MASK in batch:
            batch = batch.pop(MASK)[1]
    return (batch.union(Batch(fields)) if fields else batch), metrics


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
    if algo.dynamic_sampling == NO_FILTER:
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
