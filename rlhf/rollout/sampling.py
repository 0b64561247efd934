"""Sampling settings (and the temperature the trainer scores samples at), per-request seeds,
the rollout-vs-trainer log-prob gap and its limit.

Seeds: sample j of the prompt at position p of a `generate` call (its row in the driver's
batch) gets `derive_seed(call_seed, p, j)`, so a prompt's samples do not depend on how the
batch was split over rollout replicas. `call_seed` is the driver's `batch.meta["seed"]` when
given (resumable), else `derive_seed(rollout.seed, k)` for the k-th call of this worker.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rlhf.config import RolloutConfig
from rlhf.data.ragged import Ragged


def derive_seed(*parts: int) -> int:
    """A 31-bit seed hashed from non-negative ints; stable across processes and platforms."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)


def request_seeds(*, call_seed: int, first_prompt: int, num_prompts: int, n: int) -> list[int]:
    """Seeds of the num_prompts * n requests of prompts first_prompt.., prompt-major."""
    return [derive_seed(call_seed, first_prompt + i, j)
            for i in range(num_prompts) for j in range(n)]


def sampling_temperature(config: RolloutConfig) -> float:
    """The temperature responses were sampled at, which the trainer scores them at; greedy (0)
    is scored at temperature 1."""
    return config.temperature if config.temperature > 0 else 1.0


def sampling_params(config: RolloutConfig, *, greedy: bool, seeds: list[int],
                    max_tokens: list[int] | None = None) -> list:
    """One vLLM SamplingParams (n=1) per request: the config's sampling (rollout.min_new_tokens
    held), or greedy; each request's `max_tokens` (a multi-turn episode's room) defaults to
    rollout.max_new_tokens.

    Each request returns the log-prob of its sampled token (logprobs=0); the engine is built
    with processed log-probs, i.e. after temperature scaling, like the trainer's log-probs.
    """
    from vllm import SamplingParams  # vLLM is imported only where an engine is used

    limits = max_tokens if max_tokens is not None else [config.max_new_tokens] * len(seeds)
    common = dict(n=1, logprobs=0, stop=list(config.stop),
                  detokenize=bool(config.stop))  # stop strings need text; ids need none
    if greedy:
        return [SamplingParams(temperature=0.0, max_tokens=limit, **common) for limit in limits]
    return [SamplingParams(temperature=config.temperature, top_p=config.top_p,
                           top_k=config.top_k, seed=seed, max_tokens=limit,
                           min_tokens=min(config.min_new_tokens, limit), **common)
            for seed, limit in zip(seeds, limits, strict=True)]


def token_gaps(old_log_probs: Ragged, rollout_log_probs: Ragged,
               mask: Ragged | None = None) -> torch.Tensor:
    """|trainer - sampler| log-prob of every (masked) response token, float64 (T,)."""
    if not torch.equal(old_log_probs.offsets, rollout_log_probs.offsets):
        raise ValueError("old_log_probs and rollout_log_probs have different row lengths "
                         f"({old_log_probs.lengths.tolist()[:8]}... vs "
                         f"{rollout_log_probs.lengths.tolist()[:8]}...); compute both for the "
                         "same response_ids")
    gap_T = (old_log_probs.values.double() - rollout_log_probs.values.double()).abs()
    if mask is not None:
        if not torch.equal(mask.offsets, old_log_probs.offsets):
            raise ValueError("mask has different row lengths than the log-probs; pass the "
                             "batch's response_mask")
        gap_T = gap_T[mask.values.bool()]
    return gap_T


# The statistic the post-sync check stops on: the gap that 99% of tokens stay within. A
# broken sync moves the bulk of the tokens; dtype noise moves a few, and the largest of
# 0.3M tokens is far in that tail (figures: docs/benchmarks/2026-11-27-logprob-gap.md).
GAP_QUANTILE = 0.99
GAP_STATISTIC = f"p{round(GAP_QUANTILE * 100)}"
# rollout.max_logprob_gap_p99 when null, by the engine's dtype (figures: the page above):
# well above a healthy sync's p99 in that dtype and under the planted faults'; fp32's noise
# is orders of magnitude below bf16's, so its limit also catches faults bf16 noise hides.
DEFAULT_GAP_LIMITS = {torch.float32: 0.1, torch.bfloat16: 1.0, torch.float16: 1.0}


def gap_quantile(gap_T: torch.Tensor, q: float = GAP_QUANTILE) -> float:
    """The smallest token gap that at least a fraction `q` of the tokens do not exceed
    (nearest rank: the ceil(q * T)-th smallest); 0 without tokens, NaN when any gap is NaN
    (a broken engine's log-prob, however few)."""
    if gap_T.numel() == 0:
        return 0.0
    if bool(gap_T.isnan().any()):
        return math.nan
    rank = max(math.ceil(q * gap_T.numel()), 1)
    return float(torch.kthvalue(gap_T.flatten().cpu(), rank).values)


def logprob_gap(old_log_probs: Ragged, rollout_log_probs: Ragged,
                mask: Ragged | None = None) -> dict[str, float]:
    """Mean, p99 (the check's statistic) and max |trainer - sampler| log-prob over the
    (masked) response tokens.

    Near zero right after a weight sync when top_p = 1 and top_k = -1; with either set, vLLM's
    log-probs are those of the truncated, renormalised distribution it sampled from."""
    gap_T = token_gaps(old_log_probs, rollout_log_probs, mask)
    empty = gap_T.numel() == 0
    return {"rollout/logprob_gap_mean": 0.0 if empty else float(gap_T.mean()),
            f"rollout/logprob_gap_{GAP_STATISTIC}": gap_quantile(gap_T),
            "rollout/logprob_gap_max": 0.0 if empty else float(gap_T.max())}


def logprob_gap_limit(config: RolloutConfig, dtype: torch.dtype) -> float:
    """The check's limit: rollout.max_logprob_gap_p99, or when null the default for the
    engine's `dtype`."""
    if config.max_logprob_gap_p99 is not None:
        return config.max_logprob_gap_p99
    return DEFAULT_GAP_LIMITS[dtype]


class LogprobGapError(RuntimeError):
    """After a weight sync, vLLM's log-probs of its sampled tokens are too far from the
    trainer's: the engine is not running the policy."""


def check_logprob_gap(gap: float, *, limit: float, dtype: torch.dtype) -> None:
    """LogprobGapError naming the statistic, its value, the limit and the setting when `gap`
    (rollout/logprob_gap_p99 of samples a synced engine drew) exceeds `limit`; a NaN gap,
    which a half-initialised engine gives, exceeds every limit."""
    if gap <= limit:
        return
    name = str(dtype).removeprefix("torch.")
    raise LogprobGapError(
        f"rollout/logprob_gap_{GAP_STATISTIC} is {gap:.4g} after a weight sync, above the "
        f"limit {limit:g} (rollout.max_logprob_gap_{GAP_STATISTIC}; null picks "
        f"{DEFAULT_GAP_LIMITS[dtype]:g} for {name}): for 1% or more of the sampled tokens, "
        "vLLM's log-prob is that far from the trainer's for the same policy, so the rollout "
        "sampler does not run the policy (weights missed or corrupted by the sync, or a model "
        "vLLM computes differently). Stopping instead of training on its samples. Check the "
        "sync (sync/* metrics, a model family vLLM maps differently); raise "
        f"rollout.max_logprob_gap_{GAP_STATISTIC} only if your kernels and dtype are known to "
        "give such a gap on a healthy engine (1e9 turns the check off)")
