"""The engine's gradients: one flat fp32 buffer per rank, synced as the parameter table says.

Every trainable parameter's grad accumulates (over micro-batches, in fp32) into its range of
the flat buffer laid out by a `zero.Partition`; a hook moves each backward's `param.grad`
there, so parameters never keep a `.grad`. `GradSync` is the one grad sync, run by training
and by `rlhf verify-model`:

1. over DP (dp × cp at cp > 1, `sync_group`) the grads are SUMMED (loss_fn normalises by
   global counts), bucket by bucket:
   reduce-scattered into each rank's shard under ZeRO-1 when `GradBuffer.scatter` (only the
   owned ranges are then valid), else all-reduced whole. `scatters_grads` decides `scatter`
   once, from the backend;
2. grads partial over TP (`ParamInfo.tp_partial_grad`) are summed over TP (every TP rank
   lays its parameters out alike, so its owned ranges are the same ones);
3. the two copies of a parameter shared across pipeline stages are summed (`shared`); the
   buckets holding one take their DP sum only after this (the stages' buckets differ).

With `overlap`, step 1 starts during the backward of the last micro-batch: a bucket's
collective is launched (async) once all its parameters' grads are final, buckets in one fixed
order on every rank, and `GradSync.finish` waits for them before steps 2 and 3. The sums, and
their order, are the synchronous path's.

With expert parallelism (ep > 1) the routed experts' parameters have a buffer of their own
(`GradBuffer.expert`): the ep ranks of a dp group hold different experts, so their grads are
summed (and ZeRO-1 sharded) over the expert-data-parallel group instead of dp; at cp > 1 over
edp × cp (`edp_cp`), since the cp ranks of those ranks routed other tokens to the same experts.

`grad_norm` is the whole model's norm from the owned ranges: TP-replicated grads counted on
TP rank 0 only, a tied copy not at all, then summed over DP (ZeRO-1) and the model group; an
expert buffer's over edp × cp (ZeRO-1) and the ep group (each rank holds other experts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    `expert`: routed experts' params at ep > 1, synced over edp × cp instead of dp × cp."""

    def __init__(self, params: Sequence[nn.Parameter], part: Partition, *,
                 device: torch.device, scatter: bool = False, expert: bool = False):
        if scatter and part.shards == 1:
            raise ValueError("scatter needs a partition with several shards (ZeRO-1)")
        self.params, self.part, self.scatter = list(params), part, scatter
        self.expert = expert
        self.flat = torch.zeros(part.total, dtype=torch.float32, device=device)
        # While `final` (the last micro-batch's backward), each accumulated param i is
        # reported to `on_final(i)`: its grad will not change before the sync.
        self.final = False
        self.on_final: Callable[[int], None] | None = None
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
            if self.final and self.on_final is not None:
                self.on_final(i)
        return hook


def scatters_grads(part: Partition, dp_group) -> bool:
    """Whether a ZeRO-1 engine reduce-scatters its DP grads (the one reading of the backend).

    gloo's reduce-scatter is slower than its all-reduce of the same bucket, so on gloo buckets
    are all-reduced in place, which leaves the same sums in the owned ranges."""
    return part.shards > 1 and dist.get_backend(dp_group) != "gloo"


def sync_group(mesh: ParallelMesh, *, expert: bool):
    """The group a parameter set's grads are summed and ZeRO-1 sharded over: edp × cp for routed
    experts (at ep > 1), else dp × cp. The cp ranks of a replica ran different tokens of the
    same packs; at cp = 1 these are the edp and dp groups."""
    return mesh.edp_cp_group if expert else mesh.dp_cp_group


def data_group(grads: GradBuffer, mesh: ParallelMesh):
    """The group `grads` are summed and ZeRO-1 sharded over (`sync_group`)."""
    return sync_group(mesh, expert=grads.expert)


class GradSync:
    """The grad sync of one `GradBuffer` (see the module docstring). `table`: the entries of
    `grads.params`, in order; `rank`: this rank's shard of `grads.part` (its DP or edp rank
    under ZeRO-1, else 0); `overlap`: start the DP sums during the last backward."""

    def __init__(self, grads: GradBuffer, table: ParamTable, mesh: ParallelMesh, *, rank: int,
                 overlap: bool):
        self.grads, self.table, self.mesh, self.rank = grads, table, mesh, rank
        self.group = data_group(grads, mesh)
        part = grads.part
        self._ties = mesh.pp_size > 1 and mesh.embedding_group is not None
        tied = {b for b, bucket in enumerate(part.buckets) if self._ties and any(
            table.entries[i].shared for i in range(bucket.first, bucket.stop))}
        # Backward reaches the last parameters first: buckets start in reverse order.
        self._early = [b for b in reversed(range(len(part.buckets))) if b not in tied]
        self._late = sorted(tied)
        self._bucket_of = [b for b, bucket in enumerate(part.buckets)
                           for _ in range(bucket.first, bucket.stop)]
        self.overlap = overlap and group_size(self.group) > 1
        if self.overlap:
            grads.on_final = self._final
        self.overlapped_buckets = 0  # of the last sync: buckets whose sum began in backward
        self.reset()

    def reset(self) -> None:
        """Forget a sync in progress (the next backward starts afresh)."""
        self._waiting = [b.stop - b.first for b in self.grads.part.buckets]
        self._final_params: set[int] = set()
        self._next = 0  # the next bucket of self._early to start
        self._in_flight: list[tuple[object, Tensor | None, int, int]] = []

    def _final(self, i: int) -> None:
        if i in self._final_params:
            raise RuntimeError(
                f"parameter {self.table.entries[i].name} got a second gradient in the last "
                "micro-batch's backward, after its bucket's reduction may have started; set "
                "optim.overlap_grad_reduce=false for this model")
        self._final_params.add(i)
        self._waiting[self._bucket_of[i]] -= 1
        while self._next < len(self._early) and self._waiting[self._early[self._next]] == 0:
            self._start(self._early[self._next])
            self._next += 1

    def _start(self, b: int) -> None:
        """Launch bucket b's DP sum (async)."""
        if group_size(self.group) == 1:
            return
        part, flat = self.grads.part, self.grads.flat
        bucket = part.buckets[b]
        chunk = flat[bucket.start:bucket.start + bucket.numel]
        if not self.grads.scatter:
            work = dist.all_reduce(chunk, group=self.group, async_op=True)
            self._in_flight.append((work, None, 0, 0))
            return
        lo, hi = part.shard_ranges(self.rank)[b]
        mine = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
        work = reduce_scatter_single(mine, chunk, group=self.group, async_op=True)
        self._in_flight.append((work, mine, lo, hi))

    def _wait(self) -> None:
        for work, mine, lo, hi in self._in_flight:
            work.wait()
            if mine is not None:
                self.grads.flat[lo:hi].copy_(mine)
        self._in_flight = []

    def finish(self) -> None:
        """Complete the sync (collective over TP, pipeline ties and DP): start the buckets not
        started yet, wait for all, then the TP and tie sums and the tied buckets' DP sums."""
        grads, entries = self.grads, self.table.entries
        self.overlapped_buckets = self._next
        for b in self._early[self._next:]:
            self._start(b)
        self._wait()
        partial = [grads.view(i) for i, e in enumerate(entries) if e.tp_partial_grad]
        all_reduce_tensors(partial, group=self.mesh.tp_group)  # token chunks -> full stream
        if self._ties:
            # Both stages' copies then step identically: the full model's one tied parameter.
            tied = [grads.view(i) for i, e in enumerate(entries) if e.shared]
            all_reduce_tensors(tied, group=self.mesh.embedding_group)
        for b in self._late:
            self._start(b)
        self._wait()
        self.reset()


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
