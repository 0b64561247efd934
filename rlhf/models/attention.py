"""Varlen (packed, THD) causal attention behind one interface.

On CUDA with flash-attn installed and a half-precision input, flash-attn's varlen kernel runs
over the whole packed stream; without flash-attn, torch's own varlen flash kernel does
(rlhf.models.varlen_kernels), and where this torch has none either, a warning says so once. Everywhere
else `sdpa_split` runs PyTorch's fused SDPA kernel (flash attention for CPU, or CUDA's): one
batched call per set of sequences of one length, or one call per sequence on views of the
packed tensors when all lengths differ. Nothing crosses sequence boundaries and no padding is
computed. `sdpa_varlen` is the plain per-sequence reference the kernels are tested against.

Shared prompts (`prefix`, rlhf.data.packing.SharedPrefix): a sequence may also attend to a run
of earlier stream tokens (its prompt, held once by the first sample of its group). Its keys and
values are then that run followed by its own, gathered once per call, and the causal mask is
aligned to the bottom right (query i sees every prefix key and its own keys up to i), which is
flash-attn's convention for unequal query and key lengths.

What the kernels need on the host (sequence bounds, prefix runs, flash-attn's key bounds and
longest key run) is a `VarlenLayout`, built once per micro-batch while its stream is still on
the CPU and passed to every layer: no layer reads a device tensor back.

Why not padding, FlexAttention or nested tensors (measured on torch 2.13, CPU, fp32): padded
length buckets add padding and a gather whose backward is slower than the split's, while
batching sequences of exactly one length pads nothing and saves the per-call cost (one layer's
forward and backward on 128 sequences of 36 tokens: 0.040 s one call each, 0.023 s batched);
FlexAttention has no backward on CPU; nested-tensor SDPA has no CPU backend. The old loop was
slow because SDPA on 3-D inputs silently takes the unfused math path, and slicing (not
splitting) made each sequence's backward write a zero-filled gradient of the whole stream.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.data.packing import SharedPrefix
from rlhf.models.varlen_kernels import torch_varlen, torch_varlen_fn
from rlhf.parallel.host import to_device

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


@dataclass(frozen=True)
class VarlenLayout:
    """Where each sequence of one packed stream and its shared prefix sit, as host ints, plus
    flash-attn's key rows and key bounds on the device: built once per micro-batch on the host
    (`varlen_layout`) and read by every layer, so no layer reads a device tensor back."""

    bounds: tuple[int, ...]  # cu_seqlens
    prefix_starts: tuple[int, ...] | None  # None: nothing shared
    prefix_lens: tuple[int, ...] | None
    source_K: Tensor | None  # (K,) int64 stream row of every key (prefix, then own), or None
    cu_k: Tensor | None  # (n+1,) int32 bounds of each sequence's keys, or None
    max_k: int  # longest key run (prefix + own), max sequence length without a prefix

    def to(self, device: torch.device | str) -> VarlenLayout:
        if self.source_K is None:
            return self
        return dataclasses.replace(self, source_K=to_device(self.source_K, device),
                                   cu_k=to_device(self.cu_k, device))

    def padded(self, num_tokens: int) -> VarlenLayout:
        """The layout with sequence parallelism's dummy sequence appended up to `num_tokens`
        (`rlhf.models.outputs.sp_pad`); itself when nothing is appended."""
        extra = num_tokens - self.bounds[-1]
        if extra == 0:
            return self
        device = self.source_K.device if self.source_K is not None else "cpu"
        return _layout((*self.bounds, num_tokens),
                       None if self.prefix_starts is None else (*self.prefix_starts, 0),
                       None if self.prefix_lens is None else (*self.prefix_lens, 0), device)


def varlen_layout(cu_seqlens: Tensor, prefix: SharedPrefix | None, *,
                  device: torch.device | str | None = None) -> VarlenLayout:
    """The `VarlenLayout` of a packed stream (one read of `cu_seqlens` and `prefix`; free
    for the CPU tensors a micro-batch is packed in); its device tensors on `device` (None:
    `cu_seqlens`'s)."""
    return _layout(tuple(cu_seqlens.tolist()),
                   None if prefix is None else tuple(prefix.starts.tolist()),
                   None if prefix is None else tuple(prefix.lens.tolist()),
                   cu_seqlens.device if device is None else device)


def _layout(bounds: tuple[int, ...], starts: tuple[int, ...] | None,
            lens: tuple[int, ...] | None, device) -> VarlenLayout:
    seq_lens = [stop - start for start, stop in zip(bounds[:-1], bounds[1:])]
    if starts is None:
        return VarlenLayout(bounds, None, None, None, None, max(seq_lens, default=0))
    kv_lens = [n + p for n, p in zip(seq_lens, lens)]
    cu = torch.tensor(bounds, dtype=torch.int64)
    prefix = SharedPrefix(torch.tensor(starts, dtype=torch.int64),
                          torch.tensor(lens, dtype=torch.int64))
    source_K, kv_cu = prefix_kv_rows(cu, prefix, torch.device("cpu"), total=sum(kv_lens))
    return VarlenLayout(bounds, starts, lens, to_device(source_K, device),
                        to_device(kv_cu.to(torch.int32), device), max(kv_lens, default=0))


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
    built once per packed batch (`_length_groups`, cached) and shared by every layer. When
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
    groups = _length_groups(bounds, layout.prefix_starts, layout.prefix_lens,
                            str(q_THD.device))
    if groups is None:  # nothing to attend
        return q_THD.new_zeros(q_THD.shape[0], q_THD.shape[1], v_THD.shape[2])
    if isinstance(groups, list):  # all lengths differ, nothing shared: one call per sequence
        outs = [attend(q_SHD[None], k_SHD[None], v_SHD[None], 0)[0]
                for q_SHD, k_SHD, v_SHD in zip(q_THD.split(groups), k_THD.split(groups),
                                               v_THD.split(groups)) if q_SHD.shape[0]]
        return torch.cat(outs, dim=0)
    q_all = q_THD.index_select(0, groups.q_index)
    k_all = k_THD.index_select(0, groups.kv_index)
    v_all = v_THD.index_select(0, groups.kv_index)
    shapes = groups.shapes
    outs = []
    for q_mSHD, k_mSHD, v_mSHD, (m, length, prefix_len) in zip(
            q_all.split([m * n for m, n, _ in shapes]),
            k_all.split([m * (n + p) for m, n, p in shapes]),
            v_all.split([m * (n + p) for m, n, p in shapes]), shapes):
        out = attend(q_mSHD.view(m, length, *q_mSHD.shape[1:]),
                     k_mSHD.view(m, length + prefix_len, *k_mSHD.shape[1:]),
                     v_mSHD.view(m, length + prefix_len, *v_mSHD.shape[1:]), prefix_len)
        outs.append(out.reshape(m * length, *out.shape[2:]))
    return torch.cat(outs, dim=0).index_select(0, groups.inverse)


@dataclass(frozen=True)
class _Groups:
    """sdpa_split's batched layout: stream rows of the queries and of the keys/values of each
    (length, prefix length) group in turn, each group's (sequences, length, prefix length), and
    the rows that put the groups' outputs back in stream order."""

    q_index: Tensor
    kv_index: Tensor
    shapes: tuple[tuple[int, int, int], ...]
    inverse: Tensor


@functools.lru_cache(maxsize=16)  # a few micro-batches in flight (pipelines, recompute)
def _length_groups(bounds: tuple[int, ...], prefix_starts: tuple[int, ...] | None,
                   prefix_lens: tuple[int, ...] | None, device: str) -> _Groups | list[int] | None:
    """sdpa_split's grouping of one packed batch, built once and shared by every layer (and
    the recomputed forward): None when no sequence has tokens; the sequence lengths when all
    differ and nothing is shared (one call each); else the _Groups."""
    lengths = [stop - start for start, stop in zip(bounds[:-1], bounds[1:])]
    shared = prefix_lens if prefix_lens is not None else (0,) * len(lengths)
    runs: dict[tuple[int, int], list[int]] = {}
    for i, (length, prefix_len) in enumerate(zip(lengths, shared)):
        if length:  # an empty sequence keeps its slot in cu_seqlens, no tokens
            runs.setdefault((length, prefix_len), []).append(i)
    if not runs:
        return None
    if prefix_lens is None and all(len(seqs) == 1 for seqs in runs.values()):
        return lengths
    cu = torch.tensor(bounds, dtype=torch.int64, device=device)
    starts = cu[:-1]
    source_K = kv_cu = None
    if prefix_lens is not None:
        prefix = SharedPrefix(torch.tensor(prefix_starts, dtype=torch.int64),
                              torch.tensor(prefix_lens, dtype=torch.int64))
        source_K, kv_cu = prefix_kv_rows(cu, prefix, torch.device(device),
                                         total=bounds[-1] - bounds[0] + sum(prefix_lens))
    q_rows, kv_rows, shapes = [], [], []
    for (length, prefix_len), seqs in runs.items():
        ids = torch.tensor(seqs, device=device)
        own = (starts[ids][:, None] + torch.arange(length, device=device)).reshape(-1)
        q_rows.append(own)
        kv_rows.append(own if source_K is None else source_K[
            (kv_cu[ids][:, None] + torch.arange(prefix_len + length, device=device)).reshape(-1)])
        shapes.append((len(seqs), length, prefix_len))
    q_index = torch.cat(q_rows)
    inverse = torch.empty_like(q_index)
    inverse[q_index] = torch.arange(q_index.numel(), device=device)
    return _Groups(q_index, torch.cat(kv_rows), tuple(shapes), inverse)


def _sdpa_batch(q_BSHD: Tensor, k_BSHD: Tensor, v_BSHD: Tensor, prefix_len: int, *,
                causal: bool, scale: float, gqa: bool) -> Tensor:
    """Fused SDPA on B sequences of one length whose keys start with `prefix_len` shared
    ones (a bottom-right causal mask); out_BSHD."""
    q, k, v = (x.transpose(1, 2) for x in (q_BSHD, k_BSHD, v_BSHD))
    mask = _bottom_right_causal(q.shape[2], prefix_len, q.device) if prefix_len else None
    out_BHSD = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              is_causal=causal and not prefix_len, scale=scale,
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
        mask = _bottom_right_causal(stop - start, p_len, q_THD.device) if causal else None
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


def flash_style_keys(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *, cu_seqlens: Tensor,
                     max_seqlen: int, prefix: SharedPrefix | None,
                     layout: VarlenLayout | None) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """(k, v, cu_q, cu_k, max_k) as the flash-style varlen kernels take them: int32 bounds on
    q's device, and with a prefix each sequence's keys gathered (prefix, then own) with their
    own bounds and longest run from `layout` (built here when missing, a host read)."""
    cu = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
    if prefix is None:
        return k_THD, v_THD, cu, cu, max_seqlen
    if layout is None or layout.source_K is None:
        layout = varlen_layout(cu_seqlens, prefix, device=q_THD.device)
    return (k_THD.index_select(0, layout.source_K), v_THD.index_select(0, layout.source_K), cu,
            layout.cu_k, layout.max_k)


def prefix_kv_rows(cu_seqlens: Tensor, prefix: SharedPrefix, device: torch.device, *,
                   total: int | None = None) -> tuple[Tensor, Tensor]:
    """(source_K, kv_cu): the stream row of every key when each sequence's keys are its
    prefix's tokens then its own, sequence after sequence, and the (n+1,) int64 bounds of
    each sequence's keys in that order. The one rule of what a sequence attends to.
    `total`: the number of keys when the caller knows it (None: read back from kv_cu)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lens, shared = cu[1:] - cu[:-1], prefix.lens.to(device)
    kv_lens = lens + shared
    kv_cu = torch.cat([cu.new_zeros(1), kv_lens.cumsum(0)])
    if total is None:
        total = int(kv_cu[-1])
    seq_K = torch.repeat_interleave(torch.arange(len(lens), device=device), kv_lens,
                                    output_size=total)
    local_K = torch.arange(total, device=device) - kv_cu[:-1][seq_K]
    from_prefix = local_K < shared[seq_K]
    source_K = torch.where(from_prefix, prefix.starts.to(device)[seq_K] + local_K,
                           cu[:-1][seq_K] + local_K - shared[seq_K])
    return source_K, kv_cu


@functools.lru_cache(maxsize=256)
def _bottom_right_causal_cached(q_len: int, prefix_len: int, device: str) -> Tensor:
    return torch.ones(q_len, prefix_len + q_len, dtype=torch.bool,
                      device=device).tril(diagonal=prefix_len)


def _bottom_right_causal(q_len: int, prefix_len: int, device: torch.device) -> Tensor:
    """(q_len, prefix_len + q_len) bool: query i sees every prefix key and own keys <= i."""
    return _bottom_right_causal_cached(q_len, prefix_len, str(device))


@functools.cache
def _flash_fn() -> Callable | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except (ImportError, OSError):  # absent, or built against another torch
        return None
    return flash_attn_varlen_func
