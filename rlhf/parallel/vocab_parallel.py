"""Log-probs and entropy over vocab-sharded logits, without ever gathering the full vocabulary.

Each TP rank holds the logit columns [vocab_start, vocab_end) of a vocabulary padded up to a
multiple of tp (see `padded_vocab_size`); columns at or past `real_vocab_size` are padding and
are left out of the softmax. One fused pass computes both outputs: per token each rank takes
its local max, sum of exp and exp-weighted logit (an online log-sum-exp), then two all-reduces
of (T,)-sized statistics combine the ranks (the row max, then the rescaled sums with the target
logit). Backward needs no communication: each rank recomputes its softmax slice from the
saved logits and the global statistics, and skips the entropy term when the loss does not use
the entropy. Logits are divided by the temperature in float32, and the float32 work runs over
chunks of tokens (`token_chunk`), so the workspace beyond the logits and their grad is bounded
by the chunk; `head_workspace` counts it op by op, for the memory planner.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from rlhf.parallel.collectives import all_reduce
from rlhf.parallel.fusion import Fused

# float32 elements of one (tokens, local vocab) chunk of the head's work: two such buffers
# are live at once, so this bounds the workspace beyond the logits and their grad.
HEAD_CHUNK_ELEMENTS = 2**25
# Bytes per token of the (T,)-sized tensors the head keeps: saved statistics (row max, log of
# the sum, expected logit: fp32), target index (int64), in-shard mask (bool), both outputs.
HEAD_TOKEN_BYTES = 4 * 3 + 8 + 1 + 4 * 2


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


def token_chunk(columns: int, *, chunk_elements: int = HEAD_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk of the head's float32 work over `columns` local vocab columns."""
    return max(1, chunk_elements // max(columns, 1))


def head_workspace(*, tokens: int, columns: int, real_columns: int, dtype: torch.dtype,
                   backward: bool, chunk_elements: int = HEAD_CHUNK_ELEMENTS) -> dict[str, int]:
    """Bytes live at the peak of the log-prob/entropy head on `tokens` tokens, by op.

    The logits (the LM head's output, saved for backward), at the backward peak their grad,
    and the two float32 chunk buffers live at once (forward: upcast logits and their exp;
    backward: upcast logits and the softmax), plus the per-token statistics and outputs.
    """
    chunk = min(tokens, token_chunk(real_columns, chunk_elements=chunk_elements))
    out = {"logits": tokens * columns * dtype.itemsize}
    if backward:
        out["logits grad"] = tokens * columns * dtype.itemsize
    out["fp32 logits chunk"] = chunk * real_columns * 4
    out["softmax chunk" if backward else "exp chunk"] = chunk * real_columns * 4
    out["per-token stats"] = tokens * HEAD_TOKEN_BYTES
    return out


def vocab_parallel_log_probs_entropy(
    logits_TV_local: Tensor,
    targets_T: Tensor | None,
    *,
    group: ProcessGroup | None,
    vocab_start: int,
    vocab_end: int,
    real_vocab_size: int,
    temperature: float = 1.0,
    chunk_elements: int = HEAD_CHUNK_ELEMENTS,
    fused: bool = False,
) -> tuple[Tensor, Tensor]:
    """(log softmax(logits / temperature)[target], entropy of that softmax), each (T,)
    float32 and differentiable, over the full vocabulary; one fused pass.

    `logits_TV_local` may have extra leading dims (..., V_local); `targets_T` then has (...).
    Without targets the log-probs are meaningless (use the entropy only). `fused`: each
    chunk's float32 passes as one compiled kernel (`rlhf.models.fused`), not op by op.
    """
    n_real = _real_columns(logits_TV_local, vocab_start, vocab_end, real_vocab_size)
    lead = logits_TV_local.shape[:-1]
    if targets_T is None:
        targets_T = torch.full(lead, -1, dtype=torch.long, device=logits_TV_local.device)
    elif targets_T.shape != lead:
        raise ValueError(f"targets shape {tuple(targets_T.shape)} does not match logits "
                         f"{tuple(logits_TV_local.shape)} without the vocab dim")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    logits_TV = logits_TV_local.reshape(-1, logits_TV_local.shape[-1])
    log_probs_T, entropy_T = _VocabHead.apply(
        logits_TV, targets_T.reshape(-1) - vocab_start, group, n_real, float(temperature),
        token_chunk(n_real, chunk_elements=chunk_elements), fused)
    return log_probs_T.reshape(lead), entropy_T.reshape(lead)


def vocab_parallel_log_probs(logits_TV_local: Tensor, targets_T: Tensor, *,
                             group: ProcessGroup | None, vocab_start: int, vocab_end: int,
                             real_vocab_size: int, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[target] over the full vocabulary, (T,) float32."""
    return vocab_parallel_log_probs_entropy(
        logits_TV_local, targets_T, group=group, vocab_start=vocab_start, vocab_end=vocab_end,
        real_vocab_size=real_vocab_size, temperature=temperature)[0]


def vocab_parallel_entropy(logits_TV_local: Tensor, *, group: ProcessGroup | None,
                           vocab_start: int, vocab_end: int, real_vocab_size: int,
                           temperature: float = 1.0) -> Tensor:
    """Entropy of the full-vocabulary softmax(logits / temperature), (T,) float32."""
    return vocab_parallel_log_probs_entropy(
        logits_TV_local, None, group=group, vocab_start=vocab_start, vocab_end=vocab_end,
        real_vocab_size=real_vocab_size, temperature=temperature)[1]


def _real_columns(logits: Tensor, vocab_start: int, vocab_end: int, real_vocab_size: int) -> int:
    """How many leading local columns are real vocabulary (the rest is padding)."""
    v_local = logits.shape[-1]
    if vocab_end - vocab_start != v_local:
        raise ValueError(f"vocab range [{vocab_start}, {vocab_end}) holds "
                         f"{vocab_end - vocab_start} columns but the logits have {v_local}")
    return max(0, min(v_local, real_vocab_size - vocab_start))


def _scaled_chunk(logits_TV: Tensor, rows: slice, n_real: int, temperature: float) -> Tensor:
    """logits[rows, :n_real] / temperature as a fresh float32 tensor (safe to modify)."""
    x_CV = logits_TV[rows, :n_real].to(torch.float32, copy=True)
    return x_CV.div_(temperature) if temperature != 1.0 else x_CV


def _head_chunk_stats(logits_CV: Tensor, index_C: Tensor,
                      temperature: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk of the vocab head's forward over this rank's real columns, in float32:
    (row max, target logit, sum of exp(x - max), sum of exp(x - max) * (x - max)), with
    x = logits / temperature. -inf (x - max) is clamped to the lowest float so that
    exp * x is 0 there, not nan."""
    x_CV = logits_CV.float() / temperature
    max_C = x_CV.amax(-1)
    target_C = x_CV.gather(-1, index_C[:, None])[:, 0]
    shifted_CV = (x_CV - max_C[:, None]).clamp(min=torch.finfo(torch.float32).min)
    exp_CV = shifted_CV.exp()
    return max_C, target_C, exp_CV.sum(-1), (exp_CV * shifted_CV).sum(-1)


def _head_chunk_grad(logits_CV: Tensor, index_C: Tensor, in_shard_C: Tensor, max_C: Tensor,
                     log_sum_C: Tensor, mean_shifted_C: Tensor, grad_entropy_C: Tensor | None,
                     grad_log_probs_C: Tensor | None, temperature: float) -> Tensor:
    """One chunk of the vocab head's backward: d loss / d logits over the real columns, in
    the logits' dtype. d log p(y) / d x_v = 1[v == y] - p_v; d H / d x_v = -p_v (x_v - E_p[x])
    (x shifted by the row max, which cancels); both divided by the temperature."""
    x_CV = (logits_CV.float() / temperature - max_C[:, None]).clamp(
        min=torch.finfo(torch.float32).min)
    p_CV = (x_CV - log_sum_C[:, None]).exp()
    out_CV = torch.zeros_like(x_CV)
    if grad_entropy_C is not None:
        out_CV = -(x_CV - mean_shifted_C[:, None]) * p_CV * grad_entropy_C[:, None].float()
    if grad_log_probs_C is not None:
        lp_C = grad_log_probs_C.float()
        out_CV = out_CV - p_CV * lp_C[:, None]
        out_CV = out_CV.scatter_add(-1, index_C[:, None], (lp_C * in_shard_C)[:, None])
    return (out_CV / temperature).to(logits_CV.dtype)


head_chunk_stats = Fused(_head_chunk_stats)
head_chunk_grad = Fused(_head_chunk_grad)


class _VocabHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, local_T, group, n_real, temperature, chunk, fused):
        num_tokens = logits_TV.shape[0]
        stats = logits_TV.new_zeros((4, num_tokens), dtype=torch.float32)
        local_max_T, sum_T, weighted_T, target_T = stats  # local max; relative to it
        in_shard_T = (local_T >= 0) & (local_T < n_real)
        index_T = torch.where(in_shard_T, local_T, torch.zeros_like(local_T))
        local_max_T.fill_(float("-inf"))  # stays so on a rank holding only padding
        for start in range(0, num_tokens if n_real else 0, chunk):
            rows = slice(start, start + chunk)
            if fused:
                (local_max_T[rows], target_T[rows], sum_T[rows],
                 weighted_T[rows]) = head_chunk_stats.compiled(
                    logits_TV[rows, :n_real], index_T[rows], temperature)
                continue
            x_CV = _scaled_chunk(logits_TV, rows, n_real, temperature)
            local_max_T[rows] = x_CV.amax(-1)
            target_T[rows] = x_CV.gather(-1, index_T[rows, None])[:, 0]
            # x - max, with -inf clamped to the lowest float so exp * x is 0 there, not nan
            x_CV.sub_(local_max_T[rows, None]).clamp_(min=torch.finfo(torch.float32).min)
            exp_CV = x_CV.exp()
            sum_T[rows] = exp_CV.sum(-1)
            weighted_T[rows] = exp_CV.mul_(x_CV).sum(-1)
            del x_CV, exp_CV
        max_T = all_reduce(local_max_T.clone(), group=group, op=dist.ReduceOp.MAX)
        # rescale this rank's sums from its max to the global one: sum_v e^(x_v - M) and
        # sum_v e^(x_v - M) (x_v - M); a rank without real columns adds 0
        has_T = sum_T > 0
        scale_T = torch.where(has_T, (local_max_T - max_T).exp(), 0.0)
        shifted_weighted_T = torch.where(
            has_T, scale_T * (weighted_T + (local_max_T - max_T) * sum_T), 0.0)
        target_T = torch.where(in_shard_T, target_T - max_T, 0.0)
        sum_T, weighted_T, target_T = all_reduce(
            torch.stack([scale_T * sum_T, shifted_weighted_T, target_T]), group=group)
        log_sum_T = sum_T.log()
        mean_shifted_T = weighted_T / sum_T  # E_p[x - M]
        ctx.save_for_backward(logits_TV, index_T, in_shard_T, max_T, log_sum_T, mean_shifted_T)
        ctx.n_real, ctx.temperature, ctx.chunk, ctx.fused = n_real, temperature, chunk, fused
        ctx.set_materialize_grads(False)
        return target_T - log_sum_T, log_sum_T - mean_shifted_T

    @staticmethod
    def backward(ctx, grad_log_probs_T, grad_entropy_T):
        logits_TV, index_T, in_shard_T, max_T, log_sum_T, mean_shifted_T = ctx.saved_tensors
        n_real, temperature = ctx.n_real, ctx.temperature
        grad_TV = torch.zeros_like(logits_TV)  # padding columns get 0
        if grad_log_probs_T is None and grad_entropy_T is None:
            return grad_TV, None, None, None, None, None, None
        lp_T = None if grad_log_probs_T is None else grad_log_probs_T.float()
        for start in range(0, logits_TV.shape[0] if n_real else 0, ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            if ctx.fused:
                grad_TV[rows, :n_real] = head_chunk_grad.compiled(
                    logits_TV[rows, :n_real], index_T[rows], in_shard_T[rows], max_T[rows],
                    log_sum_T[rows], mean_shifted_T[rows],
                    None if grad_entropy_T is None else grad_entropy_T[rows],
                    None if lp_T is None else lp_T[rows], temperature)
                continue
            x_CV = _scaled_chunk(logits_TV, rows, n_real, temperature)
            x_CV.sub_(max_T[rows, None]).clamp_(min=torch.finfo(torch.float32).min)
            p_CV = x_CV.sub(log_sum_T[rows, None]).exp_()
            if grad_entropy_T is not None:
                # d H / d x_v = -p_v (x_v - E_p[x]), x shifted by the row max, which cancels
                out_CV = x_CV.sub_(mean_shifted_T[rows, None]).mul_(p_CV)
                out_CV.mul_(-grad_entropy_T[rows, None].float())
                if lp_T is not None:
                    out_CV.sub_(p_CV.mul_(lp_T[rows, None]))
            else:
                out_CV = p_CV.mul_(-lp_T[rows, None])
            if lp_T is not None:  # d log p(y) / d x_v = 1[v == y] - p_v
                out_CV.scatter_add_(-1, index_T[rows, None],
                                    (lp_T[rows] * in_shard_T[rows])[:, None])
            if temperature != 1.0:
                out_CV.div_(temperature)
            grad_TV[rows, :n_real] = out_CV
            del x_CV, p_CV, out_CV
        return grad_TV, None, None, None, None, None, None
