"""Full HF tensors from a tp x pp layout's shards, bucket by bucket (weight sync, grad checks).

What each rank exports comes from the model's `ParamTable`: every parameter (or its grad)
but the tied copies, with its full HF shape and how it is split over TP. Buckets are planned
on full sizes: at most `bucket_bytes`, a bigger tensor alone. Per bucket:

    TP   the local shards of its split tensors are packed into one byte buffer and
         all-gathered in ONE collective (`all_gather_coalesced`), then placed into full tensors;
    PP   the stage that owns the bucket packs its full tensors into one byte buffer and
         broadcasts it ONCE over the pp group; every stage yields views of that buffer.

    EP   routed experts live on one rank of their ep group (each holds E / ep of them): every
         rank lists the experts it holds (once per export, names and shapes), and per bucket
         each ep rank broadcasts its experts' full tensors in ONE byte buffer over the ep group.

Every rank of the model group receives every full tensor once and nothing twice (a tied LM
head is not exported: HF and vLLM take it from the embedding). With ep > 1 the routed experts
come after the other tensors of a stage, by owning ep rank. `ExportStream` adds up the
seconds each rank spends gathering and broadcasting, for the sync metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlhf.models.hf_io import bucketed
from rlhf.models.param_table import ParamTable
from rlhf.parallel.collectives import all_gather_coalesced, byte_offsets, byte_view
from rlhf.parallel.mesh import ParallelMesh
from rlhf.parallel.timing import Stopwatch

Bucket = list[tuple[str, Tensor]]
Spec = tuple[str, tuple[int, ...], torch.dtype]  # HF name, full shape, dtype


@dataclass(frozen=True)
class ExportItem:
    """One HF tensor to export: its name, full shape, and this rank's part of it."""

    name: str
    shape: tuple[int, ...]  # full HF shape (a padded vocabulary is cut back to its real size)
    local: Tensor  # detached; the whole tensor when replicated, else this TP rank's shard
    split_dim: int | None  # the dim it is split along over TP; None: replicated
    owner: int | None = None  # the ep rank holding it (a routed expert at ep > 1), else None

    @property
    def spec(self) -> Spec:
        return self.name, self.shape, self.local.dtype


class ExportTimes:
    """Seconds this rank spent so far in the TP gathers and in the PP broadcasts (waiting for
    the owning stage included), as the device saw them (CUDA events on a GPU, where the
    collectives return before they finish)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.gather, self.broadcast = Stopwatch(device), Stopwatch(device)

    @property
    def gather_s(self) -> float:
        return self.gather.seconds

    @property
    def broadcast_s(self) -> float:
        return self.broadcast.seconds


class ExportStream(Iterator[Bucket]):
    """Buckets of HF-named full tensors, made as they are consumed (collective: every rank
    of the model group must consume them all, in step); `times` so far."""

    def __init__(self, make: Callable[[ExportTimes], Iterator[Bucket]], *,
                 device: torch.device | str = "cpu"):
        self.times = ExportTimes(device)
        self._buckets = make(self.times)

    def __next__(self) -> Bucket:
        return next(self._buckets)


def export_full_hf_weights(model: nn.Module, table: ParamTable, mesh: ParallelMesh, *,
                           bucket_bytes: int) -> ExportStream:
    """HF-named tensors of FULL shape in buckets of at most `bucket_bytes` (a bigger one alone).

    Collective over the model group (tp x pp): every rank must run the iterator to the end, in
    step, and every rank receives every full tensor once (each DP replica gathers on its own;
    with pp > 1 the owning stage broadcasts each bucket). Replicated tensors of this stage are
    detached views of the parameters; the rest are fresh copies. A tied LM head is left out
    (HF and vLLM take it from the embedding). The stream's `times` split the seconds spent.
    """
    return export_buckets(_export_items(model, table, grads=False), mesh,
                          bucket_bytes=bucket_bytes)


def gather_full_grads(model: nn.Module, table: ParamTable, mesh: ParallelMesh) -> dict[str, Tensor]:
    """HF name -> copy of the full gradient (collective over the model group); sync the
    grads first."""
    buckets = export_buckets(_export_items(model, table, grads=True), mesh,
                             bucket_bytes=1 << 62)
    return {name: tensor.clone() for bucket in buckets for name, tensor in bucket}


def _export_items(model: nn.Module, table: ParamTable, *, grads: bool) -> list[ExportItem]:
    """What this rank exports: every parameter (or its grad) but the tied copies."""
    params = list(model.parameters())  # the table's order (named_parameters, a tie once)
    if len(params) != len(table):
        raise ValueError(f"the table has {len(table)} parameters, the model {len(params)}; "
                         "pass the table built with this model")
    items = []
    for entry, param in zip(table, params):
        if entry.tied_copy:
            continue  # stored once, under the name it shares (the tied embedding)
        tensor = param.grad if grads else param
        if tensor is None:
            raise ValueError(f"{entry.name} has no grad; run backward first")
        shape, spec = list(param.shape), entry.shard
        if spec is not None:
            shape[spec.dim] = spec.full_size
        items.append(ExportItem(name=entry.name, shape=tuple(shape), local=tensor.detach(),
                                split_dim=None if spec is None else spec.dim,
                                owner=None if entry.expert is None or entry.expert.ep == 1
                                else entry.expert.ep_rank))
    return items


def _with_remote_experts(items: Sequence[ExportItem], mesh: ParallelMesh) -> list[ExportItem]:
    """`items` with every ep rank's experts (collective over the ep group): the other tensors
    first, then the experts by owning ep rank; another rank's carry a meta `local`."""
    if mesh.ep_size == 1:
        return list(items)
    mine = [(it.name, it.shape, tuple(it.local.shape), it.local.dtype, it.split_dim)
            for it in items if it.owner is not None]
    every: list = [None] * mesh.ep_size
    dist.all_gather_object(every, mine, group=mesh.ep_group)
    local = {it.name: it for it in items if it.owner is not None}
    out = [it for it in items if it.owner is None]
    for rank, listed in enumerate(every):
        for name, shape, local_shape, dtype, split_dim in listed:
            out.append(local[name] if rank == mesh.ep_rank else ExportItem(
                name=name, shape=shape, split_dim=split_dim, owner=rank,
                local=torch.empty(local_shape, dtype=dtype, device="meta")))
    return out


def export_buckets(items: Sequence[ExportItem], mesh: ParallelMesh, *,
                   bucket_bytes: int) -> ExportStream:
    """This stage's `items` (and, with pp > 1, every other stage's) as full tensors in
    buckets of at most `bucket_bytes` (a bigger tensor alone), in stage order.

    Replicated tensors of this stage at pp = 1 are the items' own (views of parameters);
    every other tensor is a view into a fresh per-bucket buffer.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    device = items[0].local.device if items else "cpu"
    items = _with_remote_experts(items, mesh)
    if mesh.pp_size == 1:
        return ExportStream(lambda times: _stage_buckets(items, mesh, bucket_bytes, times),
                            device=device)
    return ExportStream(lambda times: _pipeline_buckets(items, mesh, bucket_bytes, times),
                        device=device)


def _bucket_indices(specs: Sequence[Spec], bucket_bytes: int) -> list[list[int]]:
    """Indices of `specs` per bucket (hf_io's bucketing rule, on full sizes)."""
    metas = ((str(i), torch.empty(shape, dtype=dtype, device="meta"))
             for i, (_, shape, dtype) in enumerate(specs))
    return [[int(i) for i, _ in bucket] for bucket in bucketed(metas, bucket_bytes)]


def _stage_buckets(items: Sequence[ExportItem], mesh: ParallelMesh, bucket_bytes: int,
                   times: ExportTimes) -> Iterator[Bucket]:
    for indices in _bucket_indices([it.spec for it in items], bucket_bytes):
        with times.gather():
            bucket = _gathered([items[i] for i in indices], mesh)
        yield bucket


def _pipeline_buckets(items: Sequence[ExportItem], mesh: ParallelMesh, bucket_bytes: int,
                      times: ExportTimes) -> Iterator[Bucket]:
    # Stage layouts are exchanged once per export: names and shapes, no tensors.
    stages: list = [None] * mesh.pp_size
    dist.all_gather_object(stages, [it.spec for it in items], group=mesh.pp_group)
    device = items[0].local.device
    for stage, specs in enumerate(stages):
        src = mesh.rank_at(dp=mesh.dp_rank, pp=stage, tp=mesh.tp_rank)
        for indices in _bucket_indices(specs, bucket_bytes):
            bucket_specs = [specs[i] for i in indices]
            offsets, total = byte_offsets(_nbytes(shape, dtype) for _, shape, dtype in bucket_specs)
            buffer = torch.empty(total, dtype=torch.uint8, device=device)
            views = [byte_view(buffer, offset, shape, dtype)
                     for offset, (_, shape, dtype) in zip(offsets, bucket_specs)]
            if stage == mesh.pp_rank:
                with times.gather():
                    _gathered([items[i] for i in indices], mesh, into=views)
            with times.broadcast():
                dist.broadcast(buffer, src=src, group=mesh.pp_group)
            yield [(name, view) for (name, _, _), view in zip(bucket_specs, views)]


def _gathered(items: Sequence[ExportItem], mesh: ParallelMesh, *,
              into: Sequence[Tensor] | None = None) -> Bucket:
    """Full tensors of `items` (collective over TP: one all-gather for all split ones),
    written `into` the given views, or else into one fresh buffer (split ones) and the
    items' own tensors (replicated ones)."""
    group = mesh.tp_group if mesh.tp_size > 1 else None
    here = [it.owner is None or it.owner == mesh.ep_rank for it in items]
    split = [i for i, it in enumerate(items)
             if it.split_dim is not None and group is not None and here[i]]
    if into is None:
        into = _fresh_views(items, split + [i for i in range(len(items)) if not here[i]])
    parts = all_gather_coalesced([items[i].local for i in split], group=group)
    for i, ranks in zip(split, parts):
        _place(into[i], ranks, dim=items[i].split_dim)
    gathered = set(split)
    for i, it in enumerate(items):
        if here[i] and i not in gathered and into[i] is not it.local:
            into[i].copy_(it.local)
    if mesh.ep_size > 1:
        _broadcast_experts(items, into, mesh)
    return [(it.name, tensor) for it, tensor in zip(items, into)]


def _broadcast_experts(items: Sequence[ExportItem], into: Sequence[Tensor],
                       mesh: ParallelMesh) -> None:
    """Each ep rank's full expert tensors of this bucket to the others: one byte buffer each."""
    device = next((t.device for t in into if t.device.type != "meta"), "cpu")
    for owner, src in enumerate(mesh.group_ranks("ep")):
        ids = [i for i, it in enumerate(items) if it.owner == owner]
        if not ids:
            continue
        offsets, total = byte_offsets(_nbytes(items[i].shape, items[i].local.dtype) for i in ids)
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        views = [byte_view(buffer, offset, items[i].shape, items[i].local.dtype)
                 for i, offset in zip(ids, offsets)]
        if owner == mesh.ep_rank:
            for i, view in zip(ids, views):
                view.copy_(into[i])
        dist.broadcast(buffer, src=src, group=mesh.ep_group)
        if owner != mesh.ep_rank:
            for i, view in zip(ids, views):
                into[i].copy_(view)


def _fresh_views(items: Sequence[ExportItem], split: list[int]) -> list[Tensor]:
    """The replicated items' own tensors, and views into one new buffer for the `split` ones
    (split over TP, or another ep rank's experts)."""
    offsets, total = byte_offsets(_nbytes(items[i].shape, items[i].local.dtype) for i in split)
    device = next((it.local.device for it in items if it.local.device.type != "meta"), "cpu")
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    views = [it.local for it in items]
    for i, offset in zip(split, offsets):
        views[i] = byte_view(buffer, offset, items[i].shape, items[i].local.dtype)
    return views


def _place(full: Tensor, ranks: Sequence[Tensor], *, dim: int) -> None:
    """full <- the TP ranks' shards concatenated along `dim`, cut to full's size: padding
    (of a vocabulary padded to a multiple of tp) is only ever at the end."""
    per_rank = ranks[0].shape[dim]
    for r, shard in enumerate(ranks):
        start = r * per_rank
        count = min(per_rank, full.shape[dim] - start)
        if count <= 0:
            break
        full.narrow(dim, start, count).copy_(shard.narrow(dim, 0, count))


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize

