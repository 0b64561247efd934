"""A CPU stand-in for flash-attn's `flash_attn_varlen_func`: its signature, its input checks
and its causal mask, aligned to the bottom right when a sequence has more keys than queries
(flash-attn >= 2.1: query i sees keys j <= i + seqlen_k - seqlen_q; a row that sees nothing
gives zeros). Computed per sequence in float32, output in the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

HALF = (torch.float16, torch.bfloat16)


def make_flash_attn_varlen_func(*, half_only: bool = True):
    """The stand-in; `half_only=False` also takes float32 (flash-attn does not), so a test can
    compare it with an fp32 reference at fp32 tolerance."""

    def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               dropout_p: float = 0.0, softmax_scale: float | None = None,
                               causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                               alibi_slopes=None, deterministic: bool = False,
                               return_attn_probs: bool = False, block_table=None) -> Tensor:
        _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, half_only)
        if dropout_p or window_size != (-1, -1) or softcap or alibi_slopes is not None \
                or return_attn_probs or block_table is not None:
            raise NotImplementedError("the stand-in implements plain (causal) attention only")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        rep = q.shape[1] // k.shape[1]  # query head h reads kv head h // rep
        outs = []
        for (q0, q1), (k0, k1) in zip(_pairs(cu_seqlens_q), _pairs(cu_seqlens_k)):
            q_HSD = q[q0:q1].float().transpose(0, 1)
            k_HSD = k[k0:k1].float().repeat_interleave(rep, dim=1).transpose(0, 1)
            v_HSD = v[k0:k1].float().repeat_interleave(rep, dim=1).transpose(0, 1)
            scores = q_HSD @ k_HSD.transpose(1, 2) * scale
            if causal:
                lq, lk = q1 - q0, k1 - k0
                keep = (torch.arange(lk)[None, :]
                        <= torch.arange(lq)[:, None] + (lk - lq))  # bottom-right aligned
                scores = scores.masked_fill(~keep, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty row gives zeros
            outs.append((probs @ v_HSD).transpose(0, 1))
        out = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2]).float()
        return out.to(q.dtype)

    return flash_attn_varlen_func


def _pairs(cu: Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _check(q, k, v, cu_q, cu_k, max_q, max_k, half_only: bool) -> None:
    """What flash-attn's kernel requires of its inputs (it reads past a wrong bound silently)."""
    allowed = HALF if half_only else (*HALF, torch.float32)
    if q.dtype not in allowed or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError(f"FlashAttention only supports fp16 and bf16, got {q.dtype}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or q.shape[1] % k.shape[1]:
        raise RuntimeError("q, k, v must be (total, heads, head_dim), q heads a multiple of k's")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu.dtype != torch.int32 or cu.device != q.device or cu.dim() != 1:
            raise RuntimeError(f"{name} must be a 1-D int32 tensor on q's device")
    if cu_q.numel() != cu_k.numel():
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must bound the same sequences")
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    lens_q, lens_k = (cu[1:] - cu[:-1] for cu in (cu_q, cu_k))
    if int(cu_q[-1]) != q.shape[0] or int(cu_k[-1]) != k.shape[0] or k.shape[0] != v.shape[0]:
        raise RuntimeError("cu_seqlens must end at the number of query / key rows")
    if lens_q.numel() and (int(lens_q.max()) > max_q or int(lens_k.max()) > max_k):
        raise RuntimeError(f"a sequence is longer than max_seqlen ({max_q}, {max_k})")
