"""Rollout correction on the driver: the sampler (vLLM) and the trainer give slightly different
probabilities to the same tokens (bf16 vs fp32, other kernels, or a stale policy when samples
are off-policy). These functions weigh or reject whole responses, or mask single tokens, by the
trainer/sampler ratio.

Inputs are packed per-token streams as everywhere in rlhf.algorithms: `old_logp_T` (trainer,
pi_old), `rollout_logp_T` (sampler), `mask_T`, `cu_seqlens`. Nothing here needs a gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlhf.algorithms.kl import kl
from rlhf.algorithms.segments import (
    check_tokens,
    count_per_sample,
    segment_sum,
    segments,
    valid_mask,
)


def sequence_log_ratios(old_logp_T: Tensor, rollout_logp_T: Tensor, mask_T: Tensor | None,
                        cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """(sum, count) per sample of old - rollout over its valid tokens: log of the sequence ratio
    pi_train(y) / pi_sampler(y), and the number of valid tokens (float64, (n,) each)."""
    num_tokens = old_logp_T.shape[0]
    check_tokens(num_tokens, rollout_logp_T=rollout_logp_T)
    valid_T = valid_mask(mask_T, num_tokens, old_logp_T.device)
    seg = segments(cu_seqlens, num_tokens, old_logp_T.device)
    diff_T = old_logp_T.detach().double() - rollout_logp_T.detach().double()
    return segment_sum(diff_T, seg, valid_T), count_per_sample(valid_T, seg).double()


@torch.no_grad()
def seq_tis_weights(old_logp_T: Tensor, rollout_logp_T: Tensor, mask_T: Tensor | None,
                    cu_seqlens: Tensor, *, cap: float) -> Tensor:
    """min(exp(sum over a sample's valid tokens of old - rollout), cap) per sample, (n,) float64;
    taken in log space so no ratio overflows."""
    if cap < 1:
        raise ValueError(f"the sequence TIS cap must be at least 1, got {cap}")
    log_ratio_N, _ = sequence_log_ratios(old_logp_T, rollout_logp_T, mask_T, cu_seqlens)
    return torch.exp(log_ratio_N.clamp(max=math.log(cap)))


@torch.no_grad()
def reject_outside_band(old_logp_T: Tensor, rollout_logp_T: Tensor, mask_T: Tensor | None,
                        cu_seqlens: Tensor, *, low: float, high: float) -> Tensor:
    """(n,) bool, True = keep: the per-token geometric mean of the sample's ratio,
    exp(mean over valid tokens of old - rollout), lies in [low, high]. The geometric mean does
    not shrink or grow with the length, so one band suits short and long responses. A sample
    without valid tokens is kept (it counts in no loss anyway)."""
    if not 0 < low <= 1 <= high:
        raise ValueError(f"the rejection band needs 0 < low <= 1 <= high, got [{low}, {high}]")
    log_ratio_N, count_N = sequence_log_ratios(old_logp_T, rollout_logp_T, mask_T, cu_seqlens)
    mean_N = log_ratio_N / count_N.clamp_min(1)
    keep_N = (mean_N >= math.log(low)) & (mean_N <= math.log(high))
    return keep_N | (count_N == 0)


@torch.no_grad()
def keep_tokens_in_band(old_logp_T: Tensor, rollout_logp_T: Tensor, *, low: float,
                        high: float) -> Tensor:
    """(T,) bool, True = keep: the token's own ratio exp(old - rollout) lies in [low, high]
    (IcePop's token mask: a token the two sides disagree on trains nothing, its response's
    other tokens still do)."""
    if not 0 < low <= 1 <= high:
        raise ValueError(f"the token band needs 0 < low <= 1 <= high, got [{low}, {high}]")
    check_tokens(old_logp_T.shape[0], rollout_logp_T=rollout_logp_T)
    log_ratio_T = old_logp_T.detach().double() - rollout_logp_T.detach().double()
    return (log_ratio_T >= math.log(low)) & (log_ratio_T <= math.log(high))


def effective_sample_size(log_weights_N: Tensor) -> float:
    """(sum w)^2 / (N sum w^2) of the weights w = exp(log_weights_N), in (0, 1]; 1 = all equal.
    From log-weights with logsumexp, so huge ratios do not overflow. 1.0 for no weights."""
    n = log_weights_N.numel()
    if n == 0:
        return 1.0
    lw_N = log_weights_N.double()
    log_ess = 2 * torch.logsumexp(lw_N, 0) - math.log(n) - torch.logsumexp(2 * lw_N, 0)
    return float(torch.exp(log_ess))


@torch.no_grad()
def rollout_correction_metrics(old_logp_T: Tensor, rollout_logp_T: Tensor,
                               mask_T: Tensor | None, cu_seqlens: Tensor, *,
                               cap: float | None = None,
                               keep_N: Tensor | None = None) -> dict[str, float]:
    """`rollout_corr/ess`: effective sample size of the sequence IS weights (capped at `cap` when
    given) over samples with a valid token; `rollout_corr/rejected_frac`: fraction of those
    samples `keep_N` rejects (0 without); `rollout_corr/kl`: k3 token mean of
    KL(sampler || trainer), the samples being the sampler's."""
    log_ratio_N, count_N = sequence_log_ratios(old_logp_T, rollout_logp_T, mask_T, cu_seqlens)
    has_N = count_N > 0
    if cap is not None:
        log_ratio_N = log_ratio_N.clamp(max=math.log(cap))
    rejected = 0.0
    if keep_N is not None and bool(has_N.any()):
        rejected = float((~keep_N[has_N]).double().mean())
    valid_T = valid_mask(mask_T, old_logp_T.shape[0], old_logp_T.device)
    kl_T = kl(rollout_logp_T.detach().double(), old_logp_T.detach().double(), "k3")
    kl_mean = float(kl_T[valid_T].mean()) if bool(valid_T.any()) else 0.0
    return {"rollout_corr/ess": effective_sample_size(log_ratio_N[has_N]),
            "rollout_corr/rejected_frac": rejected, "rollout_corr/kl": kl_mean}
