"""Policy losses by name (`algorithm.policy_loss`): ppo (token ratio), gspo (sequence ratio) and
cispo (clipped IS weight on a REINFORCE term).

Every loss takes the same arguments as `ppo_policy_loss` (log-probs, old log-probs, advantages,
mask and cu_seqlens, clip bounds, aggregation mode and global counts, optional detached IS
weights) and returns (0-d loss, metrics) with at least `clipfrac` and `approx_kl`, so the actor
calls whichever one the config names through `get_policy_loss`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlhf.algorithms.kl import kl
from rlhf.algorithms.losses import (
    LOG_RATIO_BOUND,
    _masked_mean,
    aggregate,
    policy_inputs,
    ppo_policy_loss,
)
from rlhf.algorithms.registry import lookup, register
from rlhf.algorithms.segments import count_per_sample, segment_sum, segments, to_tokens

_POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {}
# The keywords the actor passes every policy loss after its five tensors (logp_T, old_logp_T,
# advantages_T, mask_T, cu_seqlens); a loss of your own must accept them all.
POLICY_LOSS_KEYWORDS = ("clip_low", "clip_high", "clip_c", "is_weights_T", "agg_mode",
                        "global_tokens", "global_seqs", "max_response_length")


# AlgorithmConfig's (low, high) clip keys of each loss; the token ratio's unless registered.
_CLIP_KEYS: dict[str, tuple[str, str]] = {}
TOKEN_CLIP_KEYS = ("clip_ratio_low", "clip_ratio_high")


def register_policy_loss(name: str, *, clip_keys: tuple[str, str] = TOKEN_CLIP_KEYS):
    """Decorator: make a function with `ppo_policy_loss`'s signature an `algorithm.policy_loss`,
    clipped by the AlgorithmConfig fields `clip_keys` (low, high)."""
    add = register(_POLICY_LOSSES, "policy loss", name)

    def add_with_clip(fn):
        fn = add(fn)  # raises on a name taken twice, before the clip keys are written
        _CLIP_KEYS[name] = clip_keys
        return fn

    return add_with_clip


def policy_clip(algo) -> tuple[float, float]:
    """(clip_low, clip_high) the actor passes `algo.policy_loss`: the fields its entry was
    registered with (gspo's sequence-ratio range), the token ratio's clip_ratio_* otherwise."""
    low, high = _CLIP_KEYS.get(algo.policy_loss, TOKEN_CLIP_KEYS)
    return getattr(algo, low), getattr(algo, high)


def get_policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The policy loss registered under `name`, or the user function a 'module:function'
    names (ValueError listing the registered names otherwise)."""
    return lookup(_POLICY_LOSSES, "policy loss", name)


register_policy_loss("ppo")(ppo_policy_loss)


def sequence_ratio(logp_T: Tensor, old_logp_T: Tensor, valid_T: Tensor,
                   cu_seqlens: Tensor) -> Tensor:
    """GSPO's per-token ratio sg(s_i) * exp(logp - sg(logp)), s_i = exp(mean over sample i's
    valid tokens of logp - old_logp): its value is s_i on every token of sample i, its gradient
    s_i * d logp_t, so every token gets the sequence's weight. Masked tokens hold 0."""
    seg = segments(cu_seqlens, logp_T.shape[0], logp_T.device)
    log_ratio_N = (segment_sum(logp_T.detach() - old_logp_T, seg, valid_T)
                   / count_per_sample(valid_T, seg).clamp_min(1))
    seq_ratio_N = torch.exp(log_ratio_N.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    ratio_T = to_tokens(seq_ratio_N, seg) * torch.exp(logp_T - logp_T.detach())
    return ratio_T.masked_fill(~valid_T, 0)


@register_policy_loss("gspo", clip_keys=("gspo_clip_low", "gspo_clip_high"))
def gspo_policy_loss(logp_T: Tensor, old_logp_T: Tensor, advantages_T: Tensor,
                     mask_T: Tensor | None, cu_seqlens: Tensor, *, clip_low: float = 3e-4,
                     clip_high: float = 4e-4, clip_c: float | None = None,
                     agg_mode: str = "seq-mean-token-mean", is_weights_T: Tensor | None = None,
                     global_tokens=None, global_seqs=None,
                     max_response_length: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: max(-A s, -A clip(s, 1-low, 1+high)) with s the sequence ratio of
    `sequence_ratio` (clipping whole sequences). `clip_c` is ignored: dual clip is token-level.

    Metrics: clipfrac (fraction of valid tokens in clipped sequences), approx_kl (token k3)."""
    del clip_c
    valid_T, logp_T, old_logp_T, advantages_T, is_weights_T = policy_inputs(
        logp_T, old_logp_T, advantages_T, mask_T, is_weights_T)
    ratio_T = sequence_ratio(logp_T, old_logp_T, valid_T, cu_seqlens)
    surr_T = -advantages_T * ratio_T
    surr_clip_T = -advantages_T * ratio_T.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_T = torch.maximum(surr_T, surr_clip_T)
    if is_weights_T is not None:
        loss_T = loss_T * is_weights_T.detach()
    metrics = {"clipfrac": _masked_mean(surr_clip_T > surr_T, valid_T),
               "approx_kl": _masked_mean(kl(old_logp_T, logp_T, "k3"), valid_T)}
    loss = aggregate(loss_T, valid_T, cu_seqlens, agg_mode, global_tokens=global_tokens,
                     global_seqs=global_seqs, max_response_length=max_response_length)
    return loss, metrics


@register_policy_loss("cispo")
def cispo_policy_loss(logp_T: Tensor, old_logp_T: Tensor, advantages_T: Tensor,
                      mask_T: Tensor | None, cu_seqlens: Tensor, *, clip_low: float = 0.2,
                      clip_high: float = 0.2, clip_c: float | None = None,
                      agg_mode: str = "token-mean", is_weights_T: Tensor | None = None,
                      global_tokens=None, global_seqs=None,
                      max_response_length: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: -sg(min(r, 1 + clip_high)) * A * logp per token, r = pi / pi_old. The IS weight
    is clipped but never zeroes a token's gradient, which flows through logp only.
    `clip_low` and `clip_c` are ignored (CISPO caps the weight from above only).

    Metrics: clipfrac (fraction of valid tokens whose weight was capped), approx_kl (k3)."""
    del clip_low, clip_c
    valid_T, logp_T, old_logp_T, advantages_T, is_weights_T = policy_inputs(
        logp_T, old_logp_T, advantages_T, mask_T, is_weights_T)
    log_ratio_T = (logp_T.detach() - old_logp_T).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio_T = torch.exp(log_ratio_T)
    weight_T = ratio_T.clamp(max=1.0 + clip_high)
    loss_T = -weight_T * advantages_T * logp_T
    if is_weights_T is not None:
        loss_T = loss_T * is_weights_T.detach()
    metrics = {"clipfrac": _masked_mean(ratio_T > 1.0 + clip_high, valid_T),
               "approx_kl": _masked_mean(kl(old_logp_T, logp_T, "k3"), valid_T)}
    loss = aggregate(loss_T, valid_T, cu_seqlens, agg_mode, global_tokens=global_tokens,
                     global_seqs=global_seqs, max_response_length=max_response_length)
    return loss, metrics
