"""Varlen (packed, THD) causal attention behind one interface.

On CUDA with flash-attn installed and a half-precision input, flash-attn's varlen kernel runs
over the whole packed stream. Everywhere else an exact loop runs PyTorch's SDPA once per
sequence: nothing crosses sequence boundaries and no padding is computed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_attention(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *, cu_seqlens: Tensor,
                     max_seqlen: int, causal: bool = True, scale: float) -> Tensor:
    """Attention of every packed sequence with itself; returns out_THD (heads of q).

    k/v may have fewer heads than q (grouped-query attention: each k/v head serves
    num_heads / num_kv_heads consecutive query heads). `cu_seqlens` is (n+1,) int32.
    """
    assert q_THD.shape[1] % k_THD.shape[1] == 0, "query heads must be a multiple of kv heads"
    kernel = pick_kernel(q_THD.device.type, q_THD.dtype, flash_available=_flash_fn() is not None)
    return kernel(q_THD, k_THD, v_THD, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                  causal=causal, scale=scale)


def pick_kernel(device_type: str, dtype: torch.dtype, *, flash_available: bool) -> Callable:
    """The kernel `varlen_attention` uses for this device and dtype (pure, so tests check it)."""
    if device_type == "cuda" and flash_available and dtype in _FLASH_DTYPES:
        return flash_varlen
    return sdpa_varlen


def sdpa_varlen(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *, cu_seqlens: Tensor,
                max_seqlen: int, causal: bool, scale: float) -> Tensor:
    """Exact reference path: one SDPA call per sequence (max_seqlen is unused)."""
    n_rep = q_THD.shape[1] // k_THD.shape[1]
    if n_rep > 1:  # kv head j serves query heads j*n_rep .. (j+1)*n_rep-1, as in HF's repeat_kv
        k_THD = k_THD.repeat_interleave(n_rep, dim=1)
        v_THD = v_THD.repeat_interleave(n_rep, dim=1)
    bounds = cu_seqlens.tolist()
    outs = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop == start:  # an empty sequence keeps its slot in cu_seqlens but has no tokens
            continue
        q_HSD, k_HSD, v_HSD = (x[start:stop].transpose(0, 1) for x in (q_THD, k_THD, v_THD))
        out_HSD = F.scaled_dot_product_attention(q_HSD, k_HSD, v_HSD, is_causal=causal, scale=scale)
        outs.append(out_HSD.transpose(0, 1))
    if not outs:
        return q_THD.new_zeros(q_THD.shape[0], q_THD.shape[1], v_THD.shape[2])
    return torch.cat(outs, dim=0)


def flash_varlen(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *, cu_seqlens: Tensor,
                 max_seqlen: int, causal: bool, scale: float) -> Tensor:  # GPU only
    """flash-attn's varlen kernel over the packed stream (handles GQA itself)."""
    flash_attn_varlen_func = _flash_fn()
    cu = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
    return flash_attn_varlen_func(q_THD, k_THD, v_THD, cu, cu, max_seqlen, max_seqlen,
                                  dropout_p=0.0, softmax_scale=scale, causal=causal)


@functools.cache
def _flash_fn() -> Callable | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except (ImportError, OSError):  # absent, or built against another torch
        return None
    return flash_attn_varlen_func
