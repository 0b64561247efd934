"""Log-probs and entropy over vocab-sharded logits, without ever gathering the full vocabulary.

Each TP rank holds the logit columns [vocab_start, vocab_end) of a vocabulary padded up to a
multiple of tp (see `padded_vocab_size`); columns at or past `real_vocab_size` are padding and
are left out of the softmax. Forward makes two all-reduces of (T,)-sized statistics (the row
max, then the row sum of exp with the target logit or the expected logit); backward needs no
communication because each rank recomputes its softmax slice from the saved logits and the
global statistics. Only the input logits and a few (T,) vectors are kept for backward, never
a (T, V) softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from rlhf.parallel.collectives import all_reduce


def padded_vocab_size(vocab_size: int, tp: int, *, pad_to_multiple_of: int = 1) -> int:
    """Smallest size >= vocab_size divisible by tp * pad_to_multiple_of."""
    if vocab_size < 1 or tp < 1 or pad_to_multiple_of < 1:
        raise ValueError(f"vocab_size ({vocab_size}), tp ({tp}) and pad_to_multiple_of "
                         f"({pad_to_multiple_of}) must all be positive")
    step = tp * pad_to_multiple_of
    return -(-vocab_size // step) * step


def vocab_shard_range(padded_vocab: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the (padded) vocabulary held by `tp_rank`: one contiguous slice each."""
    if padded_vocab % tp_size:
        raise ValueError(f"padded vocab {padded_vocab} is not divisible by tp={tp_size}; "
                         "pad it with padded_vocab_size first")
    per_rank = padded_vocab // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def vocab_parallel_log_probs(
    logits_TV_local: Tensor,
    targets_T: Tensor,
    *,
    group: ProcessGroup | None,
    vocab_start: int,
    vocab_end: int,
    real_vocab_size: int,
) -> Tensor:
    """log softmax(logits)[target] over the full vocabulary, (T,) float32; differentiable.

    `logits_TV_local` may have extra leading dims (..., V_local); `targets_T` then has (...).
    """
    n_real = _real_columns(logits_TV_local, vocab_start, vocab_end, real_vocab_size)
    if targets_T.shape != logits_TV_local.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets_T.shape)} does not match logits "
                         f"{tuple(logits_TV_local.shape)} without the vocab dim")
    lead = targets_T.shape
    logits_TV = logits_TV_local.reshape(-1, logits_TV_local.shape[-1])
    out_T = _LogProbs.apply(logits_TV, targets_T.reshape(-1), group, vocab_start, n_real)
    return out_T.reshape(lead)


def vocab_parallel_entropy(
    logits_TV_local: Tensor,
    *,
    group: ProcessGroup | None,
    vocab_start: int,
    vocab_end: int,
    real_vocab_size: int,
) -> Tensor:
    """Entropy of the full-vocabulary softmax, (T,) float32; differentiable."""
    n_real = _real_columns(logits_TV_local, vocab_start, vocab_end, real_vocab_size)
    lead = logits_TV_local.shape[:-1]
    logits_TV = logits_TV_local.reshape(-1, logits_TV_local.shape[-1])
    return _Entropy.apply(logits_TV, group, n_real).reshape(lead)


def _real_columns(logits: Tensor, vocab_start: int, vocab_end: int, real_vocab_size: int) -> int:
    """How many leading local columns are real vocabulary (the rest is padding)."""
    v_local = logits.shape[-1]
    if vocab_end - vocab_start != v_local:
        raise ValueError(f"vocab range [{vocab_start}, {vocab_end}) holds "
                         f"{vocab_end - vocab_start} columns but the logits have {v_local}")
    return max(0, min(v_local, real_vocab_size - vocab_start))


def _shifted_logits(logits_TV: Tensor, n_real: int, group) -> tuple[Tensor, Tensor]:
    """(x - m) over the real columns in float32, and m, the row max over all ranks (T,)."""
    x_TV = logits_TV[:, :n_real].float()
    if n_real:
        local_max_T = x_TV.amax(-1)
    else:  # a rank holding only padding
        local_max_T = x_TV.new_full(x_TV.shape[:1], float("-inf"))
    max_T = all_reduce(local_max_T, group=group, op=dist.ReduceOp.MAX)
    return x_TV - max_T[:, None], max_T


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, targets_T, group, vocab_start, n_real):
        shifted_TV, max_T = _shifted_logits(logits_TV, n_real, group)
        local_T = targets_T - vocab_start
        in_shard_T = (local_T >= 0) & (local_T < n_real)
        index_T = torch.where(in_shard_T, local_T, torch.zeros_like(local_T))
        if n_real:
            target_T = shifted_TV.gather(-1, index_T[:, None])[:, 0]
            target_T = torch.where(in_shard_T, target_T, torch.zeros_like(target_T))
        else:
            target_T = shifted_TV.new_zeros(shifted_TV.shape[:1])
        # one all-reduce: the shifted target logit (from its owner) and the sum of exp
        local_sum_T = shifted_TV.exp_().sum(-1)  # the buffer is not needed any more
        target_T, sum_T = all_reduce(torch.stack([target_T, local_sum_T]), group=group)
        log_sum_T = sum_T.log()
        ctx.save_for_backward(logits_TV, index_T, in_shard_T, max_T, log_sum_T)
        ctx.n_real = n_real
        return target_T - log_sum_T

    @staticmethod
    def backward(ctx, grad_T):
        logits_TV, index_T, in_shard_T, max_T, log_sum_T = ctx.saved_tensors
        # d log p(y) / d x_v = 1[v == y] - p_v
        grad_TV = _shifted(logits_TV, ctx.n_real, max_T).sub_(log_sum_T[:, None]).exp_()
        grad_TV.mul_(-grad_T.float()[:, None])
        if ctx.n_real:
            grad_TV.scatter_add_(-1, index_T[:, None], (grad_T * in_shard_T)[:, None].float())
        return _pad_columns(grad_TV, logits_TV), None, None, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, group, n_real):
        shifted_TV, max_T = _shifted_logits(logits_TV, n_real, group)
        exp_TV = shifted_TV.exp()
        # sum_v e_v * x_v with 0 where e_v == 0 (so a -inf logit adds 0, not nan)
        weighted_T = torch.where(exp_TV > 0, exp_TV * shifted_TV, 0.0).sum(-1)
        sum_T, weighted_T = all_reduce(torch.stack([exp_TV.sum(-1), weighted_T]), group=group)
        mean_shifted_T = weighted_T / sum_T  # E_p[x - m]
        log_sum_T = sum_T.log()
        ctx.save_for_backward(logits_TV, max_T, log_sum_T, mean_shifted_T)
        ctx.n_real = n_real
        return log_sum_T - mean_shifted_T

    @staticmethod
    def backward(ctx, grad_T):
        logits_TV, max_T, log_sum_T, mean_shifted_T = ctx.saved_tensors
        # d H / d x_v = -p_v (x_v - E_p[x]); shifted by the row max, which cancels
        shifted_TV = _shifted(logits_TV, ctx.n_real, max_T)
        p_TV = (shifted_TV - log_sum_T[:, None]).exp()
        grad_TV = torch.where(p_TV > 0, p_TV * (shifted_TV - mean_shifted_T[:, None]), 0.0)
        grad_TV.mul_(-grad_T.float()[:, None])
        return _pad_columns(grad_TV, logits_TV), None, None


def _shifted(logits_TV: Tensor, n_real: int, max_T: Tensor) -> Tensor:
    """Real columns minus the saved row max, float32 (a fresh tensor, safe to modify)."""
    return logits_TV[:, :n_real].float() - max_T[:, None]


def _pad_columns(grad_TV: Tensor, like_TV: Tensor) -> Tensor:
    """Grad over the real columns -> grad over all local columns (zero on padding), like's dtype."""
    if grad_TV.shape[-1] == like_TV.shape[-1]:
        return grad_TV.to(like_TV.dtype)
    out = torch.zeros_like(like_TV)
    out[:, : grad_TV.shape[-1]] = grad_TV
    return out
