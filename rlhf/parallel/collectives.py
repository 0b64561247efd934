"""Collectives for tensor and sequence parallelism, plain and differentiable.

Every function takes the group it runs over; a size-1 group (or `group=None`, meaning "no
tensor parallelism, nothing to talk to") returns its input unchanged. The differentiable ones
are one small autograd.Function per semantic (Megatron's):

    copy_to_tp            fwd identity            bwd all-reduce
    reduce_from_tp        fwd all-reduce          bwd identity
    gather_from_tp        fwd all-gather last dim bwd split last dim
    scatter_to_tp         fwd split last dim      bwd all-gather last dim
    scatter_to_sequence   fwd split dim 0         bwd all-gather dim 0
    gather_from_sequence  fwd all-gather dim 0    bwd reduce-scatter dim 0 (or split, see there)
    reduce_scatter_to_sequence  fwd reduce-scatter dim 0   bwd all-gather dim 0

Dim 0 is the packed token axis T of a THD stream. Gloo (torch 2.13, CPU) supports all of
all_reduce (SUM, MAX), all_gather_single and reduce_scatter_single, so no fallback is needed;
its all_gather_single takes only the concatenated output form, so gathers along another dim
gather along dim 0 and concatenate the chunks. Torch 2.13 deprecates the older names
all_gather_into_tensor / reduce_scatter_tensor, used only where the new ones do not exist.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

GRAD_BUCKET_BYTES = 64 * 2**20  # at most this much gradient is flattened into one collective

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in `group`; 1 for None (no parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


# ---- plain collectives (not differentiable) ------------------------------------------------------


def all_reduce(x: Tensor, *, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> Tensor:
    """Reduced copy of `x` over `group` (the input is left untouched)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, op=op, group=group)
    return out


def all_reduce_tensors(tensors: Sequence[Tensor], *, group: ProcessGroup | None,
                       bucket_bytes: int = GRAD_BUCKET_BYTES) -> None:
    """Sum `tensors` over `group` in place, flattened into buckets (one collective each)."""
    if group_size(group) == 1 or not tensors:
        return
    for bucket in _buckets(tensors, bucket_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        for t, chunk in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(chunk.view_as(t))


def _buckets(tensors: Iterable[Tensor], bucket_bytes: int) -> Iterable[list[Tensor]]:
    """Runs of same-dtype, same-device tensors of at most bucket_bytes (a bigger one alone)."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        same = not bucket or (t.dtype, t.device) == (bucket[0].dtype, bucket[0].device)
        if bucket and (not same or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def all_gather(x: Tensor, *, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenation along `dim` of every rank's `x`, in group-rank order."""
    size = group_size(group)
    if size == 1:
        return x
    # gloo accepts only the concatenated (size * n0, ...) output, not a stacked (size, n0, ...)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    if dim % x.dim() == 0:
        return out
    return torch.cat(out.chunk(size), dim=dim)


def all_gather_coalesced(tensors: Sequence[Tensor], *,
                         group: ProcessGroup | None) -> list[list[Tensor]]:
    """Every rank's copy of each tensor through ONE all-gather of their bytes (shapes and
    dtypes must match across ranks; dtypes may differ between tensors): out[i][r] is rank
    r's tensors[i], a view into one shared buffer."""
    size = group_size(group)
    if size == 1 or not tensors:
        return [[t] for t in tensors]
    offsets, total = byte_offsets(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    for t, offset in zip(tensors, offsets):
        byte_view(flat, offset, t.shape, t.dtype).copy_(t)
    out = flat.new_empty(size * total)
    _all_gather_single(out, flat, group=group)
    return [[byte_view(out, r * total + offset, t.shape, t.dtype) for r in range(size)]
            for t, offset in zip(tensors, offsets)]


BYTE_ALIGN = 64  # every tensor in a byte buffer starts on a cache line (and any dtype's size)


def byte_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Start of each of several tensors of `sizes` bytes in one byte buffer holding them all,
    aligned; and the buffer's size."""
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += -(-nbytes // BYTE_ALIGN) * BYTE_ALIGN
    return offsets, total


def byte_view(buffer: Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """The `shape`/`dtype` tensor stored at byte `offset` of a uint8 buffer (a view)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer.narrow(0, offset, nbytes).view(dtype).view(tuple(shape))


def split(x: Tensor, *, dim: int, group: ProcessGroup | None) -> Tensor:
    """This rank's contiguous chunk of `x` along `dim`; the dim must divide evenly."""
    size = group_size(group)
    if size == 1:
        return x
    n = x.shape[dim]
    if n % size:
        raise ValueError(f"dim {dim} has {n} elements, not divisible by the group size {size}; "
                         f"pad it to a multiple of {size}")
    return x.narrow(dim, group_rank(group) * (n // size), n // size).contiguous()


def reduce_scatter(x: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """Sum over ranks of `x`, of which this rank keeps its chunk along dim 0."""
    size = group_size(group)
    if size == 1:
        return x
    n = x.shape[0]
    if n % size:
        raise ValueError(f"dim 0 has {n} elements, not divisible by the group size {size}; "
                         f"pad it to a multiple of {size}")
    out = x.new_empty((n // size, *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


# ---- differentiable collectives ------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, group=ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, dim=-1, group=group)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, dim=-1, group=ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, dim=-1, group=group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, dim=-1, group=ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, dim=0, group=group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, dim=0, group=ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return all_gather(x, dim=0, group=group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return reduce_scatter(grad, group=ctx.group), None, None
        return split(grad, dim=0, group=ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group=group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, dim=0, group=ctx.group), None


def copy_to_tp(x: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """Enter a TP region with a replicated input: identity; backward sums the partial grads."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """Leave a TP region holding partial sums: all-reduce; backward passes the grad through."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """Assemble last-dim shards into the full tensor; backward keeps this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp(x: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """Keep this rank's last-dim slice of a replicated tensor; backward all-gathers the grad."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group)


def scatter_to_sequence(x_TH: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """Keep this rank's token chunk (T/tp, ...) of a replicated stream; backward all-gathers."""
    return x_TH if group_size(group) == 1 else _ScatterToSequence.apply(x_TH, group)


def gather_from_sequence(
    x_TH: Tensor, *, group: ProcessGroup | None, grad_is_partial: bool = True
) -> Tensor:
    """All-gather token chunks into the full stream (T, ...).

    grad_is_partial: the consumer is tensor-parallel, so each rank holds a partial gradient of
    the full stream and backward reduce-scatters it. Pass False when the consumer is replicated
    (every rank computes the same full gradient): backward then just keeps this rank's chunk.
    """
    if group_size(group) == 1:
        return x_TH
    return _GatherFromSequence.apply(x_TH, group, grad_is_partial)


def reduce_scatter_to_sequence(x_TH: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """Sum partial results over ranks, keeping this rank's token chunk; backward all-gathers."""
    return x_TH if group_size(group) == 1 else _ReduceScatterToSequence.apply(x_TH, group)
