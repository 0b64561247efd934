"""The token stream one rank runs for a micro-batch, and its per-token outputs for the caller.

Every rank of a data-parallel replica receives the same micro-batches (the driver plans per dp
group). Without context parallelism a rank runs the whole pack (padded to a multiple of tp
under sequence parallelism). With cp > 1 it runs its `ContextShard` of the pack
(rlhf.parallel.context_parallel: two mirrored chunks of every sequence, so a long sequence
spans the cp ranks and short ones cost at most 2 * cp - 1 pad tokens), its attention gathering
keys and values over the cp group (a shared prompt's keys are rows of that gathered stream too,
so packs with shared prompts run at any cp), or with `cp_attention="ulysses"` exchanging heads
with it (rlhf.parallel.ulysses).

The head's per-token outputs (log-probs, entropy, values) are computed on the local rows and
all-gathered back to the whole pack, in stream order, before the loss: every cp rank then
computes the same loss on the same full outputs, so the loss function, its normalisers
(counted over dp, since each cp rank holds every sequence's targets) and the metrics are those
of cp = 1. The gather's backward keeps this rank's rows of that one gradient, so each cp rank's
parameter grads come from its own tokens only and their sum over dp × cp is the full gradient
(`rlhf.engine.grads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from rlhf.config.schema import CpAttention
from rlhf.data.packing import SharedPrefix
from rlhf.engine.micro_batch import MicroBatch
from rlhf.models.outputs import head_outputs, sp_pad
from rlhf.models.varlen_layout import VarlenLayout, context_layout, ulysses_layout
from rlhf.parallel.context_parallel import (
    ContextShard,
    plan_context_shard,
    shard_tokens,
)
from rlhf.parallel.host import to_device
from rlhf.parallel.mesh import ParallelMesh


@dataclass(frozen=True)
class RankStream:
    """What this rank feeds the model for one micro-batch: tokens, positions, sequence bounds
    and host layout; `shard`: its cp share of the pack (None at cp = 1)."""

    tokens: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    prefix: SharedPrefix | None
    layout: VarlenLayout
    shard: ContextShard | None = None
    cp_group: ProcessGroup | None = None

    @property
    def num_tokens(self) -> int:
        """Rows the model runs (SP or cp padding included): a stage boundary's token count."""
        return int(self.tokens.shape[0])


def rank_stream(mb: MicroBatch, mesh: ParallelMesh, *, tp: int, sequence_parallel: bool,
                cp_attention: CpAttention = "all_gather") -> RankStream:
    """This rank's stream of `mb` (already on the engine's device); `cp_attention`: how its
    attention spans the cp ranks (parallel.cp_attention)."""
    if mesh.cp_size == 1:
        run = sp_pad(mb.packed, tp) if sequence_parallel else mb.packed
        return RankStream(run.tokens, run.position_ids, run.cu_seqlens, run.max_seqlen,
                          run.prefix, mb.layout.padded(run.tokens.shape[0]))
    device, host = mb.packed.tokens.device, mb.layout  # host ints: nothing read back
    shard = plan_context_shard([b - a for a, b in zip(host.bounds[:-1], host.bounds[1:])],
                               cp=mesh.cp_size, rank=mesh.cp_rank,
                               multiple=tp if sequence_parallel else 1,
                               prefix_starts=host.prefix_starts, prefix_lens=host.prefix_lens)
    bounds = torch.tensor(shard.query_bounds, dtype=torch.int32)
    if cp_attention == "ulysses":
        layout = ulysses_layout(shard, host, mb.packed.prefix, group=mesh.cp_group,
                                device=device)
    else:
        layout = context_layout(shard, group=mesh.cp_group, device=device)
    return RankStream(shard_tokens(mb.packed.tokens, shard), to_device(shard.positions, device),
                      to_device(bounds, device), shard.max_query, None, layout, shard,
                      mesh.cp_group)


def stream_outputs(model: nn.Module, out: Tensor, stream: RankStream, mb: MicroBatch, *,
                   mesh: ParallelMesh, outputs: Sequence[str], temperature: float
                   ) -> dict[str, Tensor]:
    """The per-token outputs (T,) of the whole pack of `mb` from the head's raw output `out`
    on this rank's stream: `head_outputs`, of the stream's own rows at cp > 1."""
    if stream.shard is None:
        out = out[:mb.num_tokens]  # sequence parallelism's padding rows dropped
    return head_outputs(model, out, mb.packed, mesh=mesh, outputs=outputs,
                        temperature=temperature, shard=stream.shard, cp_group=stream.cp_group)
