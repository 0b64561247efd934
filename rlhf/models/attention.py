"""Varlen (packed, THD) causal attention behind one interface.

On CUDA with flash-attn installed and a half-precision input, flash-attn's varlen kernel runs
over the whole packed stream; without flash-attn, torch's own varlen flash kernel does
(rlhf.models.varlen_kernels), and where this torch has none either, a warning says so once.
Everywhere else `sdpa_split` runs PyTorch's fused SDPA kernel (flash attention for CPU, or
CUDA's): one batched call per set of sequences of one length, or one call per sequence on views
of the packed tensors when all lengths differ. Nothing crosses sequence boundaries and no
padding is computed. `sdpa_varlen` is the plain per-sequence reference the kernels are tested
against.

Shared prompts (`prefix`, rlhf.data.packing.SharedPrefix): a sequence may also attend to a run
of earlier stream tokens (its prompt, held once by the first sample of its group). Its keys and
values are then that run followed by its own, gathered once per call, and the causal mask is
aligned to the bottom right (query i sees every prefix key and its own keys up to i), which is
flash-attn's convention for unequal query and key lengths.

Context parallelism: when `layout` is a cp rank's shard (`varlen_layout.context_layout`), the
keys and values are first all-gathered over its cp group (rlhf.parallel.context_parallel) and
each local query run attends to its rows of them, bottom-right causal, through the same kernels;
a shared prompt's keys are rows of the gathered stream too, first among its sequence's keys.
With Ulysses (`varlen_layout.ulysses_layout`, rlhf.parallel.ulysses) q, k and v are instead
exchanged over heads, and these kernels run on whole sequences (and their shared prompts) for
a share of the heads.

What the kernels need on the host (sequence bounds, prefix runs, flash-attn's key bounds and
longest key run) is a `VarlenLayout` (rlhf.models.varlen_layout), built once per micro-batch
while its stream is still on the CPU and passed to every layer: no layer reads a device
tensor back.

Why not padding, FlexAttention or nested tensors: padded length buckets add padding and a
gather whose backward is slower than the split's, while batching sequences of exactly one
length pads nothing and saves the per-call cost; FlexAttention has no backward on CPU;
nested-tensor SDPA has no CPU backend. A per-sequence loop is slow when SDPA gets 3-D inputs
(it silently takes the unfused math path) or slices (each sequence's backward then writes a
zero-filled gradient of the whole stream); `sdpa_split` avoids both.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.data.packing import SharedPrefix
from rlhf.models.varlen_kernels import torch_varlen, torch_varlen_fn
from rlhf.models.varlen_layout import (
    ContextHeads,
    VarlenLayout,
    bottom_right_causal,
    flash_style_keys,
    varlen_layout,
)
from rlhf.parallel.context_parallel import gather_keys_values
from rlhf.parallel.ulysses import ulysses_attention

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_INSTALL_HINT = "pip install flash-attn --no-build-isolation"


def varlen_attention(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *, cu_seqlens: Tensor,
                     max_seqlen: int, causal: bool = True, scale: float,
                     prefix: SharedPrefix | None = None,
                     layout: VarlenLayout | None = None) -> Tensor:
    """Attention of every packed sequence with itself (and its shared `prefix`, if any);
    returns out_THD (heads of q).

    k/v may have fewer heads than q (grouped-query attention: each k/v head serves
    num_heads / num_kv_heads consecutive query heads). `cu_seqlens` is (n+1,) int32.
    `layout`: the same stream's `VarlenLayout` (built once per micro-batch); None builds it
    here, which reads `cu_seqlens` and `prefix` back to the host.
    """
    if prefix is not None and not causal:
        raise ValueError("a shared prefix needs causal attention")
    if layout is not None and layout.context is not None:
        if not causal:
            raise ValueError("context parallelism runs causal attention; pass causal=True")
        # a shard's shared prompts are already rows of its keys (plan_context_shard), or of
        # the whole stream's layout (Ulysses)
        assert prefix is None, "pass a context-parallel shard's stream without its prefix"
        if isinstance(layout.context, ContextHeads):  # Ulysses: all-to-all over heads
            heads = layout.context
            return ulysses_attention(
                q_THD, k_THD, v_THD, group=heads.group, token_rows=heads.token_rows,
                attend=lambda q, k, v: varlen_attention(
                    q, k, v, cu_seqlens=heads.cu_seqlens, max_seqlen=heads.max_seqlen,
                    scale=scale, prefix=heads.prefix, layout=heads.stream))
        k_THD = gather_keys_values(k_THD, group=layout.context.group)
        v_THD = gather_keys_values(v_THD, group=layout.context.group)
    assert q_THD.shape[1] % k_THD.shape[1] == 0, "query heads must be a multiple of kv heads"
    device_type, flash_available = q_THD.device.type, _flash_fn() is not None
    # Only a CUDA run asks for torch's kernel: its module imports torch._dynamo.
    kernel = pick_kernel(device_type, q_THD.dtype, flash_available=flash_available,
                         torch_varlen_available=device_type == "cuda"
                         and torch_varlen_fn() is not None)
    if kernel is sdpa_split and missing_flash_message(device_type, q_THD.dtype,
                                                      flash_available=flash_available):
        _warn_missing_flash_once(device_type, q_THD.dtype)
    return kernel(q_THD, k_THD, v_THD, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                  causal=causal, scale=scale, prefix=prefix, layout=layout)


def pick_kernel(device_type: str, dtype: torch.dtype, *, flash_available: bool,
                torch_varlen_available: bool = False) -> Callable:
    """The kernel `varlen_attention` uses for this device and dtype (pure, so tests check it):
    flash-attn's, else torch's own varlen flash kernel (rlhf.models.varlen_kernels), on CUDA
    in half precision; sdpa_split otherwise."""
    if device_type == "cuda" and dtype in _FLASH_DTYPES:
        if flash_available:
            return flash_varlen
        if torch_varlen_available:
            return torch_varlen
    return sdpa_split


def missing_flash_message(device_type: str, dtype: torch.dtype, *,
                          flash_available: bool) -> str | None:
    """The warning for a CUDA half-precision run that would use flash-attn but lacks it (pure)."""
    if device_type != "cuda" or flash_available or dtype not in _FLASH_DTYPES:
        return None
    return (f"flash-attn is not installed (or does not load against this torch), so {dtype} "
            "varlen attention on CUDA runs PyTorch's SDPA once per sequence, which is slower "
            f"for many short sequences. Install it with `{FLASH_INSTALL_HINT}`.")


@functools.cache
def _warn_missing_flash_once(device_type: str, dtype: torch.dtype) -> None:
    message = missing_flash_message(device_type, dtype, flash_available=False)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def sdpa_split(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *, cu_seqlens: Tensor,
               max_seqlen: int, causal: bool, scale: float,
               prefix: SharedPrefix | None = None,
               layout: VarlenLayout | None = None) -> Tensor:
    """PyTorch's fused SDPA kernel over the packed sequences, no padding (max_seqlen unused).

    Sequences of one length (and one shared-prefix length) go through one batched call: their
    q and k/v rows (prefix then own, `prefix_kv_rows`) are gathered once per call, and the
    output is put back in stream order with one gather. The grouping and its index rows are
    built once per packed batch and kept on its layout (`VarlenLayout.sdpa_groups`), shared
    by every layer. When
    every sequence differs and nothing is shared, each goes alone on `split` views instead,
    whose backward is one concatenation (slicing would zero-fill a whole-stream gradient per
    sequence). 4-D inputs, because SDPA's fused kernels refuse 3-D ones; GQA inside the kernel
    (enable_gqa) instead of materialised repeated k/v.
    """
    if layout is None:
        layout = varlen_layout(cu_seqlens, prefix, device=q_THD.device)
    bounds = layout.bounds
    if bounds[-1] - bounds[0] != q_THD.shape[0]:
        raise ValueError(f"cu_seqlens covers {bounds[-1] - bounds[0]} tokens but the packed "
                         f"tensors hold {q_THD.shape[0]}; build cu_seqlens from the same packed "
                         "batch")
    attend = functools.partial(_sdpa_batch, causal=causal, scale=scale,
                               gqa=q_THD.shape[1] != k_THD.shape[1])
    groups = layout.sdpa_groups(q_THD.device)
    if groups is None:  # nothing to attend
        return q_THD.new_zeros(q_THD.shape[0], q_THD.shape[1], v_THD.shape[2])
    if isinstance(groups, list):  # all lengths differ, nothing shared: one call per sequence
        outs = [attend(q_SHD[None], k_SHD[None], v_SHD[None], None)[0]
                for q_SHD, k_SHD, v_SHD in zip(q_THD.split(groups), k_THD.split(groups),
                                               v_THD.split(groups)) if q_SHD.shape[0]]
        return torch.cat(outs, dim=0)
    q_all = q_THD.index_select(0, groups.q_index)
    k_all = k_THD.index_select(0, groups.kv_index)
    v_all = v_THD.index_select(0, groups.kv_index)
    shapes = groups.shapes
    outs = []
    for q_mSHD, k_mSHD, v_mSHD, (m, length, prefix_len), mask in zip(
            q_all.split([m * n for m, n, _ in shapes]),
            k_all.split([m * (n + p) for m, n, p in shapes]),
            v_all.split([m * (n + p) for m, n, p in shapes]), shapes, groups.masks):
        out = attend(q_mSHD.view(m, length, *q_mSHD.shape[1:]),
                     k_mSHD.view(m, length + prefix_len, *k_mSHD.shape[1:]),
                     v_mSHD.view(m, length + prefix_len, *v_mSHD.shape[1:]), mask)
        outs.append(out.reshape(m * length, *out.shape[2:]))
    return torch.cat(outs, dim=0).index_select(0, groups.inverse)


def _sdpa_batch(q_BSHD: Tensor, k_BSHD: Tensor, v_BSHD: Tensor, mask: Tensor | None, *,
                causal: bool, scale: float, gqa: bool) -> Tensor:
    """Fused SDPA on B sequences of one length; `mask`: the bottom-right causal mask when
    their keys start with shared prefix ones, else None; out_BSHD."""
    q, k, v = (x.transpose(1, 2) for x in (q_BSHD, k_BSHD, v_BSHD))
    out_BHSD = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              is_causal=causal and mask is None, scale=scale,
                                              enable_gqa=gqa)
    return out_BHSD.transpose(1, 2)


def sdpa_varlen(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *, cu_seqlens: Tensor,
                max_seqlen: int, causal: bool, scale: float,
                prefix: SharedPrefix | None = None,
                layout: VarlenLayout | None = None) -> Tensor:
    """Reference only: plain per-sequence SDPA on 3-D slices (the unfused math path); a
    sequence with a prefix attends to k/v of its prefix's slice then its own, through an
    explicit mask."""
    n_rep = q_THD.shape[1] // k_THD.shape[1]
    if n_rep > 1:  # kv head j serves query heads j*n_rep .. (j+1)*n_rep-1, as in HF's repeat_kv
        k_THD = k_THD.repeat_interleave(n_rep, dim=1)
        v_THD = v_THD.repeat_interleave(n_rep, dim=1)
    bounds = cu_seqlens.tolist()
    n = len(bounds) - 1
    starts = prefix.starts.tolist() if prefix is not None else [0] * n
    shared = prefix.lens.tolist() if prefix is not None else [0] * n
    outs = []
    for start, stop, p_start, p_len in zip(bounds[:-1], bounds[1:], starts, shared):
        if stop == start:
            continue
        q_HSD = q_THD[start:stop].transpose(0, 1)
        k_HSD, v_HSD = (torch.cat([x[p_start:p_start + p_len], x[start:stop]]).transpose(0, 1)
                        for x in (k_THD, v_THD))
        mask = bottom_right_causal(stop - start, p_len, q_THD.device) if causal else None
        out_HSD = F.scaled_dot_product_attention(q_HSD, k_HSD, v_HSD, attn_mask=mask, scale=scale)
        outs.append(out_HSD.transpose(0, 1))
    if not outs:
        return q_THD.new_zeros(q_THD.shape[0], q_THD.shape[1], v_THD.shape[2])
    return torch.cat(outs, dim=0)


def flash_varlen(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *, cu_seqlens: Tensor,
                 max_seqlen: int, causal: bool, scale: float,
                 prefix: SharedPrefix | None = None,
                 layout: VarlenLayout | None = None) -> Tensor:  # GPU only
    """flash-attn's varlen kernel over the packed stream (handles GQA itself); with a prefix,
    over gathered k/v with their own cu_seqlens (its causal mask is bottom-right aligned).
    Every length it needs on the host comes from `layout`, so it reads nothing back."""
    flash_attn_varlen_func = _flash_fn()
    k_THD, v_THD, cu, cu_k, max_k = flash_style_keys(q_THD, k_THD, v_THD, cu_seqlens=cu_seqlens,
                                                     max_seqlen=max_seqlen, prefix=prefix,
                                                     layout=layout)
    return flash_attn_varlen_func(q_THD, k_THD, v_THD, cu, cu_k, max_seqlen, max_k,
                                  dropout_p=0.0, softmax_scale=scale, causal=causal)


@functools.cache
def _flash_fn() -> Callable | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except (ImportError, OSError):  # absent, or built against another torch
        return None
    return flash_attn_varlen_func
