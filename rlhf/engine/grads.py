"""The engine's gradients: one flat fp32 buffer per rank, synced as the parameter table says.

Every trainable parameter's grad accumulates (over micro-batches, in fp32) into its range of
the flat buffer laid out by a `zero.Partition`; a hook moves each backward's `param.grad`
there, so parameters never keep a `.grad`. `sync_grads` is the one grad sync, run by
training and by `rlhf verify-model`:

1. grads partial over TP (`ParamInfo.tp_partial_grad`) are summed over TP;
2. the two copies of a parameter shared across pipeline stages are summed (`shared`);
3. over DP the grads are SUMMED (loss_fn normalises by global counts): reduce-scattered into
   each rank's shard under ZeRO-1 when `GradBuffer.scatter` (only the owned ranges are then
   valid), else all-reduced whole. `scatters_grads` decides `scatter` once, from the backend.

With expert parallelism (ep > 1) the routed experts' parameters have a buffer of their own
(`GradBuffer.expert`): the ep ranks of a dp group hold different experts, so their grads are
summed (and ZeRO-1 sharded) over the expert-data-parallel group instead of dp.

`grad_norm` is the whole model's norm from the owned ranges: TP-replicated grads counted on
TP rank 0 only, a tied copy not at all, then summed over DP (ZeRO-1) and the model group; an
expert buffer's over edp (ZeRO-1) and the ep group (each rank holds other experts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from rlhf.engine.zero import Partition
from rlhf.models.param_table import ParamTable
from rlhf.parallel.collectives import _all_gather_single as all_gather_single
from rlhf.parallel.collectives import _reduce_scatter_single as reduce_scatter_single
from rlhf.parallel.collectives import all_reduce_tensors, group_rank, group_size
from rlhf.parallel.mesh import ParallelMesh


class GradBuffer:
    """fp32 grads of `params` in one flat buffer (allocated here, zeroed, kept for good);
    `scatter`: DP sums are reduce-scattered into the owned ranges (needs `part.shards > 1`);
    `expert`: routed experts' params at ep > 1, synced over the edp group instead of dp."""

    def __init__(self, params: Sequence[nn.Parameter], part: Partition, *,
                 device: torch.device, scatter: bool = False, expert: bool = False):
        if scatter and part.shards == 1:
            raise ValueError("scatter needs a partition with several shards (ZeRO-1)")
        self.params, self.part, self.scatter = list(params), part, scatter
        self.expert = expert
        self.flat = torch.zeros(part.total, dtype=torch.float32, device=device)
        for i, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(self._accumulate(i))

    def view(self, i: int) -> Tensor:
        """Parameter i's grad (a view of the buffer, shaped like the parameter)."""
        start = self.part.offsets[i]
        return self.flat[start:start + self.part.numels[i]].view(self.params[i].shape)

    def zero_(self) -> None:
        self.flat.zero_()

    def _accumulate(self, i: int):
        def hook(param: Tensor) -> None:
            self.view(i).add_(param.grad)  # looked up per call: offload may move the buffer
            param.grad = None
        return hook


def scatters_grads(part: Partition, dp_group) -> bool:
    """Whether a ZeRO-1 engine reduce-scatters its DP grads (the one reading of the backend).

    gloo's reduce-scatter is slower than its all-reduce of the same bucket, so on gloo buckets
    are all-reduced in place, which leaves the same sums in the owned ranges."""
    return part.shards > 1 and dist.get_backend(dp_group) != "gloo"


def data_group(grads: GradBuffer, mesh: ParallelMesh):
    """The group `grads` are summed and ZeRO-1 sharded over: edp for experts, else dp."""
    return mesh.edp_group if grads.expert else mesh.dp_group


def sync_grads(grads: GradBuffer, table: ParamTable, mesh: ParallelMesh, *, rank: int) -> None:
    """Sum the grads over TP, pipeline ties and DP (see the module docstring), in place.
    `table`: the entries of `grads.params`, in order; `rank`: this rank's shard of
    `grads.part` (its DP or edp rank under ZeRO-1, else 0)."""
    entries = table.entries
    partial = [grads.view(i) for i, e in enumerate(entries) if e.tp_partial_grad]
    all_reduce_tensors(partial, group=mesh.tp_group)  # token chunks -> full-stream grads
    if mesh.pp_size > 1 and mesh.embedding_group is not None:
        # Both stages' copies then step identically: the full model's one tied parameter.
        tied = [grads.view(i) for i, e in enumerate(entries) if e.shared]
        all_reduce_tensors(tied, group=mesh.embedding_group)
    group = data_group(grads, mesh)
    if group_size(group) == 1:
        return
    part, flat = grads.part, grads.flat
    for bucket, (lo, hi) in zip(part.buckets, part.shard_ranges(rank)):
        chunk = flat[bucket.start:bucket.start + bucket.numel]
        if not grads.scatter:
            dist.all_reduce(chunk, group=group)
        else:
            mine = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
            reduce_scatter_single(mine, chunk, group=group)
            flat[lo:hi].copy_(mine)


def owned_views(grads: GradBuffer, rank: int) -> list[Tensor]:
    """The ranges of the flat buffer `rank` owns (valid after `sync_grads`), bucket order."""
    return [grads.flat[lo:hi] for lo, hi in grads.part.shard_ranges(rank)]


def grad_norm(buffers: Sequence[tuple[GradBuffer, ParamTable, int]],
              mesh: ParallelMesh) -> Tensor:
    """L2 norm of the whole model's synced gradient, 0-d fp32, the same on every rank.
    `buffers`: each grad buffer with the table of its params and this rank's shard of it."""
    total = torch.zeros((), dtype=torch.float32, device=buffers[0][0].flat.device)
    for grads, table, rank in buffers:
        total = total + _squared_norm(grads, table, mesh, rank=rank)
    if group_size(mesh.mp_group) > 1:
        dist.all_reduce(total, group=mesh.mp_group)
    return total.sqrt()


def _squared_norm(grads: GradBuffer, table: ParamTable, mesh: ParallelMesh, *,
                  rank: int) -> Tensor:
    """This model-parallel rank's share of the squared norm, summed over the ranks holding
    other parts of the same parameters (ZeRO-1 shards; for experts, the ep group)."""
    count_replicated = group_rank(mesh.tp_group) == 0
    pieces = [grads.flat[grads.part.offsets[p.param] + p.start:
                         grads.part.offsets[p.param] + p.stop]
              for p in grads.part.pieces(rank)
              if not table.entries[p.param].tied_copy
              and (count_replicated or table.entries[p.param].shard is not None)]
    total = torch.zeros((), dtype=torch.float32, device=grads.flat.device)
    if pieces:
        total += get_total_norm(pieces).square()
    if grads.part.shards > 1:
        dist.all_reduce(total, group=data_group(grads, mesh))
    if grads.expert:
        dist.all_reduce(total, group=mesh.ep_group)
    return total


@torch.no_grad()
def clip_(grads: GradBuffer, total_norm: Tensor, max_norm: float, *, rank: int) -> None:
    """Scale the owned grads by min(1, max_norm / (norm + 1e-6)): torch's
    `clip_grads_with_norm_` with the global norm."""
    # torch's clipping scales its arguments' `.grad`: leaf holders sharing the owned ranges'
    # storage carry them (built per call: offloading may have moved the buffer).
    holders = []
    for view in owned_views(grads, rank):
        holder = view.detach()
        holder.grad = view
        holders.append(holder)
    clip_grads_with_norm_(holders, max_norm, total_norm)


def gather_grads(grads: GradBuffer, mesh: ParallelMesh) -> Tensor:
    """A full flat copy of the synced grads: the owned ranges all-gathered over DP (edp for
    experts) under ZeRO-1 (collective over that group), else the buffer itself."""
    part = grads.part
    if part.shards == 1:
        return grads.flat
    group = data_group(grads, mesh)
    out = torch.empty_like(grads.flat)
    for bucket, (lo, hi) in zip(part.buckets, part.shard_ranges(group_rank(group))):
        all_gather_single(out[bucket.start:bucket.start + bucket.numel],
                          grads.flat[lo:hi].contiguous(), group=group)
    return out
