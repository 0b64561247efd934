"""How the engine walks a list of micro-batches through the model: the pipeline schedule.

A schedule has two methods over the same plain list of `MicroBatch`:
    forward(micro_batches, outputs, temperature)           -> per-micro-batch outputs
    forward_backward(micro_batches, loss_fn, outputs, ...) -> per-micro-batch loss, metrics
With pp = 1 this is a loop (`NoPipeline`). A pipelined schedule (1F1B, interleaved; in
`rlhf.engine.pipeline`) implements the same two methods over its stage; every stage receives
the same list, so it knows every micro-batch's token count and hence every send/recv shape.
Its results exist on the last stage only (the engine broadcasts the reduced metrics from
there over the pipeline group; other stages return empty lists). Gradients are left
accumulated in the parameters; the engine syncs them afterwards, so callers never see which
schedule ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import nn

from rlhf.engine.loss_fn import LossFn, MicroBatchResult, Outputs, check_loss, detached
from rlhf.engine.micro_batch import MicroBatch
from rlhf.engine.pipeline import Interleaved1F1B, OneFOneB
from rlhf.engine.router_aux import micro_batch_routing, routing_outputs
from rlhf.models.build import BuiltModel
from rlhf.models.outputs import check_outputs, check_tp_matches, head_outputs, sp_pad
from rlhf.models.tp_sharding import TPState
from rlhf.parallel.mesh import ParallelMesh

__all__ = ["LossFn", "MicroBatchResult", "NoPipeline", "Outputs", "Schedule", "make_schedule"]


class Schedule(Protocol):
    """What the engine asks of a schedule; see the module docstring."""

    def forward(self, micro_batches: Sequence[MicroBatch], *, outputs: tuple[str, ...],
                temperature: float = 1.0) -> list[Outputs]: ...

    def forward_backward(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *,
                         outputs: tuple[str, ...],
                         temperature: float = 1.0) -> list[MicroBatchResult]: ...


class NoPipeline:
    """pp = 1: each micro-batch runs the whole model; backward right after its forward."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, *, tp: TPState, device):
        check_tp_matches(tp, mesh)
        self.model, self.mesh, self.device = model, mesh, device
        self._tp, self._sp = tp.tp, tp.sequence_parallel

    def _outputs(self, mb: MicroBatch, outputs: tuple[str, ...], temperature: float, *,
                 training: bool = False) -> Outputs:
        # model_outputs' steps, with the micro-batch's host layout passed to every layer
        if mb.num_tokens == 0:
            raise ValueError("the packed micro-batch has no tokens; skip empty micro-batches")
        run = sp_pad(mb.packed, self._tp) if self._sp else mb.packed
        routing = micro_batch_routing(self.model, mb, outputs)
        out = self.model(run.tokens, run.position_ids, run.cu_seqlens, run.max_seqlen,
                         prefix=run.prefix, layout=mb.layout.padded(run.tokens.shape[0]),
                         routing=routing)
        return {**head_outputs(self.model, out[:mb.num_tokens], mb.packed, mesh=self.mesh,
                               outputs=outputs, temperature=temperature),
                **routing_outputs(self.model, routing, outputs, with_aux=training)}

    def forward(self, micro_batches, *, outputs, temperature=1.0):
        check_outputs(self.model, outputs, temperature)
        return [self._outputs(mb.to(self.device), outputs, temperature) for mb in micro_batches]

    def forward_backward(self, micro_batches, loss_fn, *, outputs, temperature=1.0):
        check_outputs(self.model, outputs, temperature)
        results = []
        for mb in micro_batches:
            mb = mb.to(self.device)
            loss, metrics = loss_fn(self._outputs(mb, outputs, temperature, training=True), mb)
            check_loss(loss)
            loss.backward()  # frees this micro-batch's activations before the next one
            results.append(MicroBatchResult(loss.detach(), detached(metrics)))
        return results


def make_schedule(built: BuiltModel, mesh: ParallelMesh, *, device) -> Schedule:
    """The schedule for this mesh: a plain loop at pp = 1, else 1F1B (one chunk per rank) or
    interleaved 1F1B (several: vpp > 1), from `rlhf.engine.pipeline`."""
    if mesh.pp_size == 1:
        return NoPipeline(built.model, mesh, tp=built.tp, device=device)
    cls = Interleaved1F1B if built.chunks is not None and len(built.chunks) > 1 else OneFOneB
    return cls(built.model, mesh, chunks=built.chunks, tp=built.tp, device=device)
