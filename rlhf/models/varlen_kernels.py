"""PyTorch's own varlen flash kernel as a `varlen_attention` kernel: the CUDA half-precision
path where flash-attn is not installed.

`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) runs the flash-attention kernel that
ships inside PyTorch over the whole packed stream, forward and backward, with no extra package.
Its contract is flash-attn's: cu_seqlens for queries and for keys, causal masking aligned to
the bottom right when a sequence has more keys than queries (our shared-prefix rule), so a
shared prefix is handled as `attention.flash_varlen` handles it, through gathered k/v rows.

Its keywords moved between releases, so the call is built from the signature: causal is
`is_causal=True` in 2.10 and `window_size=(-1, 0)` from 2.11; `scale` is absent in 2.10 (q is
rescaled instead); grouped-query k/v are passed as they are with `enable_gqa=True` (2.12+),
and before that, whose documentation gives k/v the query's head count, repeated per query head
as transformers' repeat_kv does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from torch import Tensor

from rlhf.data.packing import SharedPrefix
from rlhf.models.varlen_layout import VarlenLayout, flash_style_keys


@functools.cache
def torch_varlen_fn() -> Callable | None:
    """`torch.nn.attention.varlen.varlen_attn`, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def call_keywords(fn: Callable) -> frozenset[str]:
    """The keyword arguments of `fn` that the call adapts to (see the module docstring)."""
    params = inspect.signature(fn).parameters
    return frozenset(k for k in ("is_causal", "window_size", "scale", "enable_gqa") if k in params)


def torch_varlen(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *, cu_seqlens: Tensor,
                 max_seqlen: int, causal: bool, scale: float,
                 prefix: SharedPrefix | None = None,
                 layout: VarlenLayout | None = None) -> Tensor:  # CUDA, half precision only
    """torch's varlen flash kernel over the packed stream; with a prefix, over gathered k/v
    with their own cu_seqlens (bottom-right causal), taken from `layout` as flash_varlen
    takes them, so nothing is read back."""
    varlen_attn = torch_varlen_fn()
    keywords = call_keywords(varlen_attn)
    k_THD, v_THD, cu, cu_k, max_k = flash_style_keys(q_THD, k_THD, v_THD, cu_seqlens=cu_seqlens,
                                                     max_seqlen=max_seqlen, prefix=prefix,
                                                     layout=layout)
    kwargs = {}
    if causal:
        kwargs.update({"window_size": (-1, 0)} if "window_size" in keywords
                      else {"is_causal": True})
    if "scale" in keywords:
        kwargs["scale"] = scale
    elif scale != q_THD.shape[-1] ** -0.5:  # the kernel's default scale; fold ours into q
        q_THD = q_THD * (scale * q_THD.shape[-1] ** 0.5)
    n_rep = q_THD.shape[1] // k_THD.shape[1]
    if n_rep > 1:
        if "enable_gqa" in keywords:
            kwargs["enable_gqa"] = True
        else:  # kv head j serves query heads j*n_rep .. (j+1)*n_rep-1
            k_THD = k_THD.repeat_interleave(n_rep, dim=1)
            v_THD = v_THD.repeat_interleave(n_rep, dim=1)
    return varlen_attn(q_THD, k_THD, v_THD, cu, cu_k, max_seqlen, max_k, **kwargs)
