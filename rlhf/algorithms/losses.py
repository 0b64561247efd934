"""Token losses of the actor and critic and their reduction to one number (`aggregate`).

Micro-batches and data-parallel ranks: pass `global_tokens` / `global_seqs` (from
`loss_normalizers`, summed over every micro-batch of the mini-batch on every DP rank) and each
micro-batch loss becomes its share of the mini-batch loss, so summing the micro-batch losses
(backward on each, gradients accumulated) gives exactly the full mini-batch loss. Across DP
ranks the gradients must then be summed, not averaged (or the loss multiplied by the DP size).
Without them, the loss is normalised by the counts of this call's tokens/sequences only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algorithms.kl import kl
from rlhf.algorithms.registry import lookup, register
from rlhf.algorithms.segments import (
    Segments,
    check_tokens,
    count_per_sample,
    segment_sum,
    segments,
    valid_mask,
)

LOG_RATIO_BOUND = 20.0  # the PPO ratio exp(logp - old_logp) is taken of a log-ratio within +-20


@dataclass(frozen=True)
class Normalizer:
    """What an aggregation mode divides by; None = this call's own count."""

    global_tokens: int | float | Tensor | None = None
    global_seqs: int | float | Tensor | None = None
    max_response_length: int | None = None


_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, Segments, Normalizer], Tensor]] = {}


def register_loss_agg(name: str):
    """Decorator: make `fn(loss_T, valid_T, seg, norm) -> 0-d loss` a `loss_agg_mode`."""
    return register(_AGGREGATIONS, "loss aggregation mode", name)


def get_loss_agg(name: str) -> Callable[[Tensor, Tensor, Segments, Normalizer], Tensor]:
    """The aggregation registered under `name` (ValueError listing the known names otherwise)."""
    return lookup(_AGGREGATIONS, "loss aggregation mode", name)


def _seq_count(valid_T: Tensor, seg: Segments, norm: Normalizer) -> Tensor | float:
    # Sequences without a valid token contribute nothing, so they do not dilute the mean.
    if norm.global_seqs is not None:
        return norm.global_seqs
    return (count_per_sample(valid_T, seg) > 0).sum().clamp_min(1)


@register_loss_agg("token-mean")
def _token_mean(loss_T: Tensor, valid_T: Tensor, seg: Segments, norm: Normalizer) -> Tensor:
    """Sum over valid tokens / number of valid tokens."""
    total = loss_T.masked_fill(~valid_T, 0).sum()
    count = norm.global_tokens if norm.global_tokens is not None else valid_T.sum().clamp_min(1)
    return total / count


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(loss_T: Tensor, valid_T: Tensor, seg: Segments,
                        norm: Normalizer) -> Tensor:
    """Sum over each sequence's valid tokens, mean over sequences."""
    return segment_sum(loss_T, seg, valid_T).sum() / _seq_count(valid_T, seg, norm)


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(loss_T: Tensor, valid_T: Tensor, seg: Segments,
                         norm: Normalizer) -> Tensor:
    """Mean over each sequence's valid tokens, mean over sequences."""
    per_seq_N = segment_sum(loss_T, seg, valid_T) / count_per_sample(valid_T, seg).clamp_min(1)
    return per_seq_N.sum() / _seq_count(valid_T, seg, norm)


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_T: Tensor, valid_T: Tensor, seg: Segments,
                             norm: Normalizer) -> Tensor:
    """Sum over each sequence's valid tokens / max_response_length, mean over sequences."""
    if norm.max_response_length is None or norm.max_response_length <= 0:
        raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs a positive "
                         f"max_response_length, got {norm.max_response_length}")
    per_seq_N = segment_sum(loss_T, seg, valid_T) / norm.max_response_length
    return per_seq_N.sum() / _seq_count(valid_T, seg, norm)


def aggregate(loss_T: Tensor, mask_T: Tensor | None, cu_seqlens: Tensor, mode: str, *,
              global_tokens: int | float | Tensor | None = None,
              global_seqs: int | float | Tensor | None = None,
              max_response_length: int | None = None) -> Tensor:
    """Reduce per-token losses to a 0-d loss by `mode` (see the module docstring for the
    global counts). Masked tokens may hold NaN/inf; nothing here divides by zero."""
    for name, value in (("global_tokens", global_tokens), ("global_seqs", global_seqs)):
        if isinstance(value, (int, float)) and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    agg = get_loss_agg(mode)
    seg = segments(cu_seqlens, loss_T.shape[0], loss_T.device)
    valid_T = valid_mask(mask_T, loss_T.shape[0], loss_T.device)
    return agg(loss_T, valid_T, seg, Normalizer(global_tokens, global_seqs, max_response_length))


def loss_normalizers(mask_T: Tensor | None, cu_seqlens: Tensor) -> tuple[int, int]:
    """(valid tokens, sequences with a valid token) of one micro-batch; sum these over the
    mini-batch and DP ranks to get `global_tokens` and `global_seqs`."""
    tokens, seqs = normalizer_counts(mask_T, cu_seqlens).tolist()
    return tokens, seqs


def normalizer_counts(mask_T: Tensor | None, cu_seqlens: Tensor) -> Tensor:
    """`loss_normalizers` as a (2,) int64 tensor, left where it was computed (no host read)."""
    num_tokens = mask_T.shape[0] if mask_T is not None else int(cu_seqlens[-1])
    seg = segments(cu_seqlens, num_tokens, cu_seqlens.device)
    valid_T = valid_mask(mask_T, num_tokens, cu_seqlens.device)
    return torch.stack([valid_T.sum(), (count_per_sample(valid_T, seg) > 0).sum()])


def _zero_masked(valid_T: Tensor, *tensors_T: Tensor) -> list[Tensor]:
    """Zero masked tokens before any math, so garbage there (NaN, inf) cannot reach a gradient:
    a later masked_fill zeroes the loss but not 0 * NaN in the backward pass."""
    return [t.masked_fill(~valid_T, 0) for t in tensors_T]


def _masked_mean(x_T: Tensor, valid_T: Tensor) -> Tensor:
    """Detached mean over valid tokens, 0 when there are none: a metric, not a loss."""
    x_T = x_T.detach().to(torch.float32)
    return x_T.masked_fill(~valid_T, 0).sum() / valid_T.sum().clamp_min(1)


def truncated_is_weights(old_log_probs_T: Tensor, rollout_log_probs_T: Tensor,
                         cap: float) -> Tensor:
    """min(pi_train / pi_sampler, cap) per token: corrects for the sampler's numerics differing
    from the trainer's (clamped in log space, so no ratio overflows)."""
    log_ratio_T = (old_log_probs_T - rollout_log_probs_T).clamp(max=math.log(cap))
    return torch.exp(log_ratio_T)


def policy_inputs(logp_T: Tensor, old_logp_T: Tensor, advantages_T: Tensor,
                  mask_T: Tensor | None, is_weights_T: Tensor | None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The valid-token mask and the policy-loss inputs with masked tokens zeroed, after checking
    that every per-token input has one entry per token (shared by every policy loss)."""
    num_tokens = logp_T.shape[0]
    check_tokens(num_tokens, old_logp_T=old_logp_T, advantages_T=advantages_T,
                 is_weights_T=is_weights_T)
    valid_T = valid_mask(mask_T, num_tokens, logp_T.device)
    logp_T, old_logp_T, advantages_T = _zero_masked(valid_T, logp_T, old_logp_T, advantages_T)
    if is_weights_T is not None:
        (is_weights_T,) = _zero_masked(valid_T, is_weights_T)
    return valid_T, logp_T, old_logp_T, advantages_T, is_weights_T


def ppo_policy_loss(logp_T: Tensor, old_logp_T: Tensor, advantages_T: Tensor,
                    mask_T: Tensor | None, cu_seqlens: Tensor, *, clip_low: float = 0.2,
                    clip_high: float = 0.2, clip_c: float | None = None,
                    agg_mode: str = "token-mean", is_weights_T: Tensor | None = None,
                    global_tokens=None, global_seqs=None,
                    max_response_length: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate max(-A r, -A clip(r, 1-low, 1+high)), r = pi / pi_old; with `clip_c`,
    tokens with A < 0 are capped at -A clip_c (dual clip). `is_weights_T` scales token losses.

    Metrics (detached 0-d, over valid tokens): clipfrac, clipfrac_lower (dual clip active) and
    approx_kl, the k3 estimate of KL(pi_old || pi) (non-negative, unlike the mean of k1).
    """
    valid_T, logp_T, old_logp_T, advantages_T, is_weights_T = policy_inputs(
        logp_T, old_logp_T, advantages_T, mask_T, is_weights_T)
    log_ratio_T = (logp_T - old_logp_T).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio_T = torch.exp(log_ratio_T)
    surr_T = -advantages_T * ratio_T
    surr_clip_T = -advantages_T * ratio_T.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_T = torch.maximum(surr_T, surr_clip_T)
    metrics = {"clipfrac": _masked_mean(surr_clip_T > surr_T, valid_T)}
    if clip_c is not None:
        if clip_c <= 1:
            raise ValueError(f"clip_c (dual clip) must be greater than 1, got {clip_c}")
        cap_T = -advantages_T * clip_c
        lower_T = (advantages_T < 0) & (loss_T > cap_T)
        loss_T = torch.where(lower_T, cap_T, loss_T)
        metrics["clipfrac_lower"] = _masked_mean(lower_T, valid_T)
    if is_weights_T is not None:
        loss_T = loss_T * is_weights_T.detach()  # weights correct the sampler; never trained
    metrics["approx_kl"] = _masked_mean(kl(old_logp_T, logp_T, "k3"), valid_T)
    loss = aggregate(loss_T, valid_T, cu_seqlens, agg_mode, global_tokens=global_tokens,
                     global_seqs=global_seqs, max_response_length=max_response_length)
    return loss, metrics


def value_loss(values_T: Tensor, old_values_T: Tensor, returns_T: Tensor,
               mask_T: Tensor | None, cu_seqlens: Tensor, *, clip: float | None = None,
               agg_mode: str = "token-mean", global_tokens=None, global_seqs=None,
               max_response_length: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2); clip None = unclipped.

    Metric clipfrac: fraction of valid tokens where the clipped term is the larger one.
    """
    num_tokens = values_T.shape[0]
    check_tokens(num_tokens, old_values_T=old_values_T, returns_T=returns_T)
    valid_T = valid_mask(mask_T, num_tokens, values_T.device)
    values_T, old_values_T, returns_T = _zero_masked(valid_T, values_T, old_values_T, returns_T)
    loss_T = (values_T - returns_T).square()
    if clip is None:
        clipfrac = torch.zeros((), device=values_T.device)
    else:
        if clip <= 0:
            raise ValueError(f"value clip must be positive or None, got {clip}")
        clipped_T = old_values_T + (values_T - old_values_T).clamp(-clip, clip)
        loss_clip_T = (clipped_T - returns_T).square()
        clipfrac = _masked_mean(loss_clip_T > loss_T, valid_T)
        loss_T = torch.maximum(loss_T, loss_clip_T)
    loss = 0.5 * aggregate(loss_T, valid_T, cu_seqlens, agg_mode, global_tokens=global_tokens,
                           global_seqs=global_seqs, max_response_length=max_response_length)
    return loss, {"clipfrac": clipfrac}


def entropy_bonus(entropy_T: Tensor, mask_T: Tensor | None, cu_seqlens: Tensor, *,
                  agg_mode: str = "token-mean", global_tokens=None, global_seqs=None,
                  max_response_length: int | None = None) -> Tensor:
    """Aggregated token entropy; the actor loss subtracts entropy_coeff times this."""
    return aggregate(entropy_T, mask_T, cu_seqlens, agg_mode, global_tokens=global_tokens,
                     global_seqs=global_seqs, max_response_length=max_response_length)


def kl_loss(logp_T: Tensor, ref_logp_T: Tensor, mask_T: Tensor | None, cu_seqlens: Tensor, *,
            kind: str = "k3", agg_mode: str = "token-mean", global_tokens=None,
            global_seqs=None, max_response_length: int | None = None) -> Tensor:
    """Aggregated KL(pi || ref) estimate of `kind`; the actor loss adds kl_loss_coef times this."""
    check_tokens(logp_T.shape[0], ref_logp_T=ref_logp_T)
    valid_T = valid_mask(mask_T, logp_T.shape[0], logp_T.device)
    logp_T, ref_logp_T = _zero_masked(valid_T, logp_T, ref_logp_T)
    return aggregate(kl(logp_T, ref_logp_T, kind), valid_T, cu_seqlens, agg_mode,
                     global_tokens=global_tokens, global_seqs=global_seqs,
                     max_response_length=max_response_length)
