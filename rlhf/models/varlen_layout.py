"""Where each sequence of a packed stream sits, read once per micro-batch: `VarlenLayout`.

What the attention kernels need on the host (sequence bounds, shared-prefix runs, flash-style
key bounds and longest key run) is built once per micro-batch while its stream is still on
the CPU and passed to every layer: no layer reads a device tensor back. The same layout holds
what `sdpa_split` derives from it on a device (its grouping of sequences into equal lengths,
index rows and masks), built on first use and freed with the micro-batch that owns it.

Shared prompts (`prefix`, rlhf.data.packing.SharedPrefix): a sequence's keys are its prefix's
tokens, then its own (`prefix_kv_rows`, the one rule of what a sequence attends to).

Context parallelism (`context_layout`, rlhf.parallel.context_parallel): the stream is one cp
rank's query runs, and each run's keys are rows of the keys all-gathered over the cp group
(`ContextKeys`), causal aligned to the bottom right as with a prefix; a sharing sequence's runs
read its prefix's gathered rows first (`plan_context_shard` places them, the same rule as
`prefix_kv_rows`: prefix, then own), so the layout itself carries no prefix. With Ulysses
(`ulysses_layout`, rlhf.parallel.ulysses) the heads travel instead (`ContextHeads`): attention
runs on the whole stream, for a share of the heads, under the pack's own unsharded layout
(shared prompts included).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from rlhf.data.packing import SharedPrefix
from rlhf.parallel.context_parallel import ContextShard
from rlhf.parallel.host import to_device


@dataclass(frozen=True)
class ContextKeys:
    """A context-parallel stream's keys: gathered over `group` (the cp group; None: one rank),
    run j's keys at rows key_bounds[j]..key_bounds[j + 1] of `VarlenLayout.source_K`."""

    group: ProcessGroup | None
    key_bounds: tuple[int, ...]


@dataclass(frozen=True)
class ContextHeads:
    """A context-parallel stream whose heads are exchanged over `group` (Ulysses): attention
    runs on the whole pack (`cu_seqlens`, `max_seqlen`, `stream`: its unsharded layout, and
    `prefix`: its shared prompts), whose tokens sit at rows `token_rows` of the gathered
    stream."""

    group: ProcessGroup | None
    token_rows: Tensor  # (T,) int64 on the device
    cu_seqlens: Tensor  # (n+1,) int32 on the device
    max_seqlen: int
    stream: VarlenLayout
    prefix: SharedPrefix | None = None


@dataclass(frozen=True)
class VarlenLayout:
    """Where each sequence of one packed stream and its shared prefix sit, as host ints, plus
    flash-attn's key rows and key bounds on the device: built once per micro-batch on the host
    (`varlen_layout`) and read by every layer, so no layer reads a device tensor back."""

    bounds: tuple[int, ...]  # cu_seqlens
    prefix_starts: tuple[int, ...] | None  # None: nothing shared
    prefix_lens: tuple[int, ...] | None
    # (K,) int64 stream row of every key (prefix, then own; under context parallelism the
    # gathered stream's row), or None
    source_K: Tensor | None
    cu_k: Tensor | None  # (n+1,) int32 bounds of each sequence's keys, or None
    max_k: int  # longest key run (prefix + own), max sequence length without a prefix
    # sdpa_split's grouping per device (`sdpa_groups`): kept with the layout, so every layer
    # and the recomputed forward share it and it is freed with the micro-batch.
    _sdpa_groups: dict = field(default_factory=dict, compare=False, repr=False)
    context: ContextKeys | ContextHeads | None = None  # None: keys are the stream's own (no cp)

    def to(self, device: torch.device | str) -> VarlenLayout:
        if self.source_K is None:
            return self
        return dataclasses.replace(self, source_K=to_device(self.source_K, device),
                                   cu_k=to_device(self.cu_k, device), _sdpa_groups={})

    def padded(self, num_tokens: int) -> VarlenLayout:
        """The layout with sequence parallelism's dummy sequence appended up to `num_tokens`
        (`rlhf.models.outputs.sp_pad`); itself when nothing is appended."""
        extra = num_tokens - self.bounds[-1]
        if extra == 0:
            return self
        if self.context is not None:
            raise ValueError(f"a context-parallel shard holds {self.bounds[-1]} tokens, not a "
                             f"multiple of the tp size; plan it with multiple=tp")
        device = self.source_K.device if self.source_K is not None else "cpu"
        return _layout((*self.bounds, num_tokens),
                       None if self.prefix_starts is None else (*self.prefix_starts, 0),
                       None if self.prefix_lens is None else (*self.prefix_lens, 0), device)

    def sdpa_groups(self, device: torch.device | str) -> SdpaGroups | list[int] | None:
        """sdpa_split's grouping of this stream with its index rows on `device` (built on the
        first call): None when no sequence has tokens; the sequence lengths when all differ
        and nothing is shared (one call each); else the `SdpaGroups`."""
        key = str(device)
        if key not in self._sdpa_groups:
            self._sdpa_groups[key] = (
                _sdpa_groups(self.bounds, self.prefix_starts, self.prefix_lens, key)
                if self.context is None else _context_sdpa_groups(self, key))
        return self._sdpa_groups[key]


def context_layout(shard: ContextShard, *, group: ProcessGroup | None,
                   device: torch.device | str) -> VarlenLayout:
    """The `VarlenLayout` of one cp rank's shard: its query runs, and the gathered-stream rows
    of their keys (a shared prompt's first) on `device`; attention gathers the keys over
    `group`."""
    kv_cu = torch.tensor(shard.key_bounds, dtype=torch.int32)
    return VarlenLayout(shard.query_bounds, None, None, to_device(shard.key_rows, device),
                        to_device(kv_cu, device), shard.max_key,
                        context=ContextKeys(group, shard.key_bounds))


def ulysses_layout(shard: ContextShard, stream: VarlenLayout, prefix: SharedPrefix | None, *,
                   group: ProcessGroup | None, device: torch.device | str) -> VarlenLayout:
    """The `VarlenLayout` of one cp rank's shard of a pack when attention exchanges heads over
    `group` (rlhf.parallel.ulysses): its query runs, and the whole pack's own layout `stream`
    (with its shared prompts, `prefix`) that attention runs under."""
    if stream.context is not None:
        raise ValueError("ulysses_layout takes the whole pack's layout, not a cp shard's")
    cu = torch.tensor(stream.bounds, dtype=torch.int32)
    lens = [b - a for a, b in zip(stream.bounds[:-1], stream.bounds[1:])]
    heads = ContextHeads(group, to_device(shard.token_rows, device), to_device(cu, device),
                         max(lens, default=0), stream.to(device),
                         None if prefix is None else prefix.to(device))
    return VarlenLayout(shard.query_bounds, None, None, None, None, shard.max_query,
                        context=heads)


def _context_sdpa_groups(layout: VarlenLayout, device: str) -> SdpaGroups | None:
    """sdpa_split's grouping of a context-parallel shard: query runs of one (length, key
    length) batched together, their key rows taken from the gathered stream."""
    assert isinstance(layout.context, ContextKeys) and layout.source_K is not None
    bounds, key_bounds = layout.bounds, layout.context.key_bounds
    runs: dict[tuple[int, int], list[int]] = {}
    for j in range(len(bounds) - 1):
        length = bounds[j + 1] - bounds[j]
        if length:
            runs.setdefault((length, key_bounds[j + 1] - key_bounds[j]), []).append(j)
    if not runs:
        return None
    key_rows = to_device(layout.source_K, device)
    q_rows, kv_rows, shapes, masks = [], [], [], []
    for (length, keys), seqs in runs.items():
        q_rows.append(torch.cat([torch.arange(bounds[j], bounds[j + 1]) for j in seqs]))
        kv_rows.append(torch.cat([torch.arange(key_bounds[j], key_bounds[j + 1]) for j in seqs]))
        shapes.append((len(seqs), length, keys - length))
        masks.append(bottom_right_causal(length, keys - length, torch.device(device))
                     if keys > length else None)
    q_index = torch.cat(q_rows)
    inverse = torch.empty_like(q_index)
    inverse[q_index] = torch.arange(q_index.numel())
    return SdpaGroups(to_device(q_index, device), key_rows[to_device(torch.cat(kv_rows), device)],
                      tuple(shapes), tuple(masks), to_device(inverse, device))


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


@dataclass(frozen=True)
class SdpaGroups:
    """sdpa_split's batched layout: stream rows of the queries and of the keys/values of each
    (length, prefix length) group in turn, each group's (sequences, length, prefix length) and
    bottom-right causal mask (None without a prefix), and the rows that put the groups'
    outputs back in stream order."""

    q_index: Tensor
    kv_index: Tensor
    shapes: tuple[tuple[int, int, int], ...]
    masks: tuple[Tensor | None, ...]
    inverse: Tensor


def _sdpa_groups(bounds: tuple[int, ...], prefix_starts: tuple[int, ...] | None,
                 prefix_lens: tuple[int, ...] | None,
                 device: str) -> SdpaGroups | list[int] | None:
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
    # The index rows are built on the host, then moved with one pinned, non-blocking copy
    # each: a host tensor copied to CUDA from pageable memory would wait for the stream.
    cu = torch.tensor(bounds, dtype=torch.int64)
    starts = cu[:-1]
    source_K = kv_cu = None
    if prefix_lens is not None:
        prefix = SharedPrefix(torch.tensor(prefix_starts, dtype=torch.int64),
                              torch.tensor(prefix_lens, dtype=torch.int64))
        source_K, kv_cu = prefix_kv_rows(cu, prefix, torch.device("cpu"),
                                         total=bounds[-1] - bounds[0] + sum(prefix_lens))
    q_rows, kv_rows, shapes, masks = [], [], [], []
    for (length, prefix_len), seqs in runs.items():
        ids = torch.tensor(seqs)
        own = (starts[ids][:, None] + torch.arange(length)).reshape(-1)
        q_rows.append(own)
        kv_rows.append(own if source_K is None else source_K[
            (kv_cu[ids][:, None] + torch.arange(prefix_len + length)).reshape(-1)])
        shapes.append((len(seqs), length, prefix_len))
        masks.append(bottom_right_causal(length, prefix_len, torch.device(device))
                     if prefix_len else None)
    q_index = torch.cat(q_rows)
    inverse = torch.empty_like(q_index)
    inverse[q_index] = torch.arange(q_index.numel())
    return SdpaGroups(to_device(q_index, device), to_device(torch.cat(kv_rows), device),
                      tuple(shapes), tuple(masks), to_device(inverse, device))


def flash_style_keys(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *, cu_seqlens: Tensor,
                     max_seqlen: int, prefix: SharedPrefix | None,
                     layout: VarlenLayout | None) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """(k, v, cu_q, cu_k, max_k) as the flash-style varlen kernels take them: int32 bounds on
    q's device, and with a prefix each sequence's keys gathered (prefix, then own) with their
    own bounds and longest run from `layout` (built here when missing, a host read)."""
    cu = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
    if layout is not None and layout.context is not None:  # k_THD: the gathered stream
        return (k_THD.index_select(0, layout.source_K), v_THD.index_select(0, layout.source_K),
                cu, layout.cu_k, layout.max_k)
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


def bottom_right_causal(q_len: int, prefix_len: int, device: torch.device) -> Tensor:
    """(q_len, prefix_len + q_len) bool: query i sees every prefix key and own keys <= i."""
    return torch.ones(q_len, prefix_len + q_len, dtype=torch.bool,
                      device=device).tril(diagonal=prefix_len)
