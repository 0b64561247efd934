"""Advantage estimators on packed response tokens; each returns `(advantages_T, returns_T)`.

Estimators run on the driver after rollout, without autograd. Both outputs are 0 at masked
tokens. Register a new one with `@register_advantage("name")`, or name a function of your own
in `algorithm.adv_estimator` ('package.module:function' or 'path/to/file.py:function').
What an estimator needs is read from its parameters: one that takes `values_T` gets a critic,
one that takes `group_ids` compares the rollout.n responses of each prompt.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from rlhf.algorithms.registry import lookup, register
from rlhf.algorithms.segments import (
    Segments,
    check_tokens,
    last_valid_index,
    reverse_scan,
    scatter_valid,
    segment_sum,
    segments,
    to_tokens,
    valid_mask,
)

_ADVANTAGES: dict[str, Callable] = {}

# Everything the driver can hand an estimator, by keyword; each takes the subset it names.
ADVANTAGE_INPUTS = ("token_rewards_T", "values_T", "scores_N", "group_ids", "cu_seqlens",
                    "mask_T", "gamma", "lam", "norm_adv_by_std")
CRITIC_INPUT = "values_T"  # an estimator taking it needs a trained critic
GROUP_INPUT = "group_ids"  # an estimator taking it compares the responses of one prompt


def register_advantage(name: str):
    """Decorator: make an estimator available as `adv_estimator: name`."""
    return register(_ADVANTAGES, "advantage estimator", name)


def get_advantage(name: str) -> Callable:
    """The estimator registered under `name`, or the user function a 'module:function' names
    (ValueError with the registered names otherwise)."""
    return lookup(_ADVANTAGES, "advantage estimator", name)


def advantage_inputs(name: str) -> tuple[set[str], set[str]]:
    """(inputs estimator `name` takes, of those the ones it requires); a ValueError when it
    requires one the driver never passes (not in ADVANTAGE_INPUTS)."""
    params = inspect.signature(get_advantage(name)).parameters.values()
    takes = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    required = {p.name for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    foreign = sorted(required - set(ADVANTAGE_INPUTS))
    if foreign:
        raise ValueError(f"advantage estimator {name!r} requires {foreign}, which the trainer "
                         f"never passes; it may take any of {list(ADVANTAGE_INPUTS)} (give "
                         f"other parameters a default)")
    return takes & set(ADVANTAGE_INPUTS), required


def compute_advantage(name: str, **inputs) -> tuple[Tensor, Tensor]:
    """Call estimator `name` with the subset of `inputs` it takes, so one call site fits all.

    Inputs outside ADVANTAGE_INPUTS are rejected (a misspelt name is not silently dropped).
    """
    unknown = sorted(set(inputs) - set(ADVANTAGE_INPUTS))
    if unknown:
        raise ValueError(f"no advantage estimator takes {unknown}; known inputs: "
                         f"{sorted(ADVANTAGE_INPUTS)}")
    takes, required = advantage_inputs(name)
    missing = sorted(required - set(inputs))
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs {missing}")
    return get_advantage(name)(**{k: v for k, v in inputs.items() if k in takes})


# ---------------------------------------------------------------------------------- helpers


def masked_whiten(x_T: Tensor, mask_T: Tensor | None, shift_mean: bool = True,
                  eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the valid tokens (unbiased std); 0 at masked tokens.

    With `shift_mean=False` the mean is added back: only the scale changes.
    """
    valid_T = valid_mask(mask_T, x_T.shape[0], x_T.device)
    x_V = x_T[valid_T]
    count = x_V.numel()
    if count == 0:
        return torch.zeros_like(x_T)
    mean = x_V.mean()
    # Bessel-corrected like torch.std; one token has no spread, so its variance is taken as 0.
    var = ((x_V - mean) ** 2).sum() / (count - 1) if count > 1 else torch.zeros_like(mean)
    out_V = (x_V - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out_V = out_V + mean
    return scatter_valid(out_V, valid_T)


def scores_to_token_rewards(scores_N: Tensor, cu_seqlens: Tensor,
                            mask_T: Tensor | None) -> Tensor:
    """Token rewards (T,): each sample's score on its last valid token, 0 elsewhere.

    A sample without a valid token has nowhere to receive its score, so it is dropped.
    """
    seg, valid_T = _layout(cu_seqlens, mask_T, scores_N, num_tokens=None)
    _check_samples(seg, scores_N=scores_N)
    last_N = last_valid_index(seg, valid_T)
    has_N = last_N >= 0
    out_T = scores_N.new_zeros(seg.num_tokens)
    out_T[last_N[has_N]] = scores_N[has_N]
    return out_T


def _layout(cu_seqlens: Tensor, mask_T: Tensor | None, like: Tensor,
            num_tokens: int | None) -> tuple[Segments, Tensor]:
    """Segments and bool mask of a stream; its length comes from the mask or cu_seqlens."""
    if num_tokens is None:
        num_tokens = mask_T.shape[0] if mask_T is not None else int(cu_seqlens[-1])
    seg = segments(cu_seqlens, num_tokens, like.device)
    return seg, valid_mask(mask_T, num_tokens, like.device)


def _check_samples(seg: Segments, **tensors_N: Tensor) -> None:
    for name, t in tensors_N.items():
        if tuple(t.shape) != (seg.num_samples,):
            raise ValueError(f"{name} has shape {tuple(t.shape)} but cu_seqlens bounds "
                             f"{seg.num_samples} samples")


def _group_centre(scores_N: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sample: score - group mean, unbiased group std (0 for a group of one), group size."""
    _, group_N, count_G = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums_G = scores_N.new_zeros(count_G.numel()).index_add(0, group_N, scores_N)
    centred_N = scores_N - (sums_G / count_G)[group_N]
    sq_G = scores_N.new_zeros(count_G.numel()).index_add(0, group_N, centred_N**2)
    std_G = (sq_G / (count_G - 1).clamp_min(1)).sqrt()
    return centred_N, std_G[group_N], count_G[group_N]


def _group_inputs(scores_N, group_ids, cu_seqlens,
                  mask_T) -> tuple[Tensor, Segments, Tensor]:
    """Checked (float scores, segments, bool mask) of a group estimator's inputs."""
    seg, valid_T = _layout(cu_seqlens, mask_T, scores_N, num_tokens=None)
    _check_samples(seg, scores_N=scores_N, group_ids=group_ids)
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be integers, got {group_ids.dtype}")
    if not scores_N.dtype.is_floating_point:  # e.g. 0/1 correctness rewards built as ints
        scores_N = scores_N.to(torch.get_default_dtype())
    return scores_N, seg, valid_T


def _per_sample_to_tokens(adv_N: Tensor, seg: Segments, valid_T: Tensor) -> Tensor:
    return to_tokens(adv_N, seg).masked_fill(~valid_T, 0)


# ------------------------------------------------------------------------------- estimators


@register_advantage("gae")
@torch.no_grad()
def gae(token_rewards_T: Tensor, values_T: Tensor, cu_seqlens: Tensor, mask_T: Tensor | None,
        *, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation per sample, value 0 after its last token.

    Masked tokens are skipped as if absent (their rewards and values are ignored); returns are
    advantages + values before the optional batch whitening of the advantages.
    """
    seg, valid_T = _layout(cu_seqlens, mask_T, values_T, token_rewards_T.shape[0])
    check_tokens(seg.num_tokens, values_T=values_T)
    sub = seg.compact(valid_T)
    r_V, v_V = token_rewards_T[valid_T], values_T[valid_T]
    has_next_V = sub.positions() < sub.lengths_N[sub.sample_T] - 1
    next_v_V = v_V.roll(-1).masked_fill(~has_next_V, 0)
    delta_V = r_V + gamma * next_v_V - v_V
    adv_V = reverse_scan(delta_V, sub, gamma * lam)
    advantages_T = scatter_valid(adv_V, valid_T)
    returns_T = scatter_valid(adv_V + v_V, valid_T)
    if whiten:
        advantages_T = masked_whiten(advantages_T, valid_T)
    return advantages_T, returns_T


@register_advantage("grpo")
@torch.no_grad()
def grpo(scores_N: Tensor, group_ids: Tensor, cu_seqlens: Tensor, mask_T: Tensor | None,
         *, norm_adv_by_std: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """(score - group mean) / (group std + eps) on every token; std is unbiased (torch.std).

    `norm_adv_by_std=False` keeps only the centring (Dr. GRPO). A group of one gets 0.
    """
    scores_N, seg, valid_T = _group_inputs(scores_N, group_ids, cu_seqlens, mask_T)
    centred_N, std_N, _ = _group_centre(scores_N, group_ids)
    # A group of one is centred to exactly 0, so it gets 0 with or without the std.
    adv_N = centred_N / (std_N + eps) if norm_adv_by_std else centred_N
    advantages_T = _per_sample_to_tokens(adv_N, seg, valid_T)
    return advantages_T, advantages_T.clone()


@register_advantage("rloo")
@torch.no_grad()
def rloo(scores_N: Tensor, group_ids: Tensor, cu_seqlens: Tensor,
         mask_T: Tensor | None) -> tuple[Tensor, Tensor]:
    """Score minus the mean score of the other samples of its group; a group of one gets 0."""
    scores_N, seg, valid_T = _group_inputs(scores_N, group_ids, cu_seqlens, mask_T)
    centred_N, _, size_N = _group_centre(scores_N, group_ids)
    # s - (sum - s) / (k - 1) == (s - mean) * k / (k - 1): no second pass over the group.
    # A group of one: centred is exactly 0, so the clamp only avoids 0 / 0.
    adv_N = centred_N * size_N / (size_N - 1).clamp_min(1)
    advantages_T = _per_sample_to_tokens(adv_N, seg, valid_T)
    return advantages_T, advantages_T.clone()


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(token_rewards_T: Tensor, cu_seqlens: Tensor, mask_T: Tensor | None,
                        *, gamma: float = 1.0, whiten: bool = True) -> tuple[Tensor, Tensor]:
    """Discounted returns-to-go per sample (masked tokens skipped), whitened over the batch.

    Returns are the raw returns-to-go; advantages are their whitened version.
    """
    seg, valid_T = _layout(cu_seqlens, mask_T, token_rewards_T, token_rewards_T.shape[0])
    sub = seg.compact(valid_T)
    returns_T = scatter_valid(reverse_scan(token_rewards_T[valid_T], sub, gamma), valid_T)
    advantages_T = masked_whiten(returns_T, valid_T) if whiten else returns_T.clone()
    return advantages_T, returns_T


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(scores_N: Tensor, group_ids: Tensor, cu_seqlens: Tensor,
                                 mask_T: Tensor | None, *,
                                 whiten: bool = True) -> tuple[Tensor, Tensor]:
    """Score minus its group mean on every token, then whitened over all valid batch tokens.

    Whitening is per token, so longer responses weigh more in the batch statistics.
    """
    scores_N, seg, valid_T = _group_inputs(scores_N, group_ids, cu_seqlens, mask_T)
    centred_N, _, _ = _group_centre(scores_N, group_ids)
    advantages_T = _per_sample_to_tokens(centred_N, seg, valid_T)
    if whiten:
        advantages_T = masked_whiten(advantages_T, valid_T)
    return advantages_T, advantages_T.clone()


def sequence_scores(token_rewards_T: Tensor, cu_seqlens: Tensor,
                    mask_T: Tensor | None) -> Tensor:
    """Per-sample sum of the valid token rewards, (n,): the scores of the group estimators
    when the KL penalty was folded into token rewards."""
    seg, valid_T = _layout(cu_seqlens, mask_T, token_rewards_T, token_rewards_T.shape[0])
    return segment_sum(token_rewards_T, seg, valid_T)
