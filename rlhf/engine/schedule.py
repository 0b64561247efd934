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
schedule ran. `forward_backward` enters `final_backward()` around each model chunk's backward
of the last micro-batch, where the engine's grads become final (it may start their sync then).
At pp = 1 an empty micro-batch is a padding one of expert parallelism: it only
joins the MoE layers' token exchanges (`rlhf.models.expert_sharding.idle_expert_exchange`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from rlhf.config.schema import CpAttention
from rlhf.data.routes import ROUTES
from rlhf.engine.loss_fn import (
    FinalBackward,
    LossFn,
    MicroBatchResult,
    Outputs,
    check_loss,
    detached,
)
from rlhf.engine.micro_batch import MicroBatch
from rlhf.engine.pipeline import Interleaved1F1B, OneFOneB
from rlhf.engine.rank_stream import rank_stream, stream_outputs
from rlhf.engine.recompute import Recomputed
from rlhf.engine.router_aux import micro_batch_routing, routing_outputs
from rlhf.models.build import BuiltModel
from rlhf.models.expert_sharding import idle_expert_exchange
from rlhf.models.outputs import check_outputs, check_tp_matches
from rlhf.models.tp_sharding import TPState
from rlhf.parallel.mesh import ParallelMesh
from rlhf.trace import span

__all__ = ["LossFn", "MicroBatchResult", "NoPipeline", "Outputs", "Schedule", "make_schedule"]

_PADDING = "_expert_exchange"  # a padding micro-batch's exchange, kept out of the outputs


class Schedule(Protocol):
    """What the engine asks of a schedule; see the module docstring."""

    def forward(self, micro_batches: Sequence[MicroBatch], *, outputs: tuple[str, ...],
                temperature: float = 1.0) -> list[Outputs]: ...

    def forward_backward(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *,
                         outputs: tuple[str, ...], temperature: float = 1.0,
                         final_backward: FinalBackward = contextlib.nullcontext
                         ) -> list[MicroBatchResult]: ...


class NoPipeline:
    """pp = 1: each micro-batch runs the whole model; backward right after its forward."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, *, tp: TPState, device,
                 cp_attention: CpAttention = "all_gather"):
        check_tp_matches(tp, mesh)
        self.model, self.mesh, self.device = model, mesh, device
        self._tp, self._sp = tp.tp, tp.sequence_parallel
        self._cp_attention: CpAttention = cp_attention

    def _outputs(self, mb: MicroBatch, outputs: tuple[str, ...], temperature: float, *,
                 training: bool = False) -> Outputs:
        # model_outputs' steps, with the micro-batch's host layout passed to every layer
        if mb.num_tokens == 0:
            return self._padding_outputs(outputs)
        run = rank_stream(mb, self.mesh, tp=self._tp, sequence_parallel=self._sp,
                          cp_attention=self._cp_attention)
        routing = micro_batch_routing(self.model, mb, outputs, run)
        out = self.model(run.tokens, run.position_ids, run.cu_seqlens, run.max_seqlen,
                         prefix=run.prefix, layout=run.layout, routing=routing)
        return {**stream_outputs(self.model, out, run, mb, mesh=self.mesh, outputs=outputs,
                                 temperature=temperature),
                **routing_outputs(self.model, routing, outputs, with_aux=training, stream=run)}

    def _padding_outputs(self, outputs: tuple[str, ...]) -> Outputs:
        """An empty micro-batch (expert parallelism pads the plan with them so every rank of an
        ep group runs as many): it joins the expert exchanges; its outputs have no tokens."""
        # recompute "full" wraps whole decoder layers: their exchanges run again in backward
        full = any(isinstance(layer, Recomputed) for layer in self.model.model.layers.values())
        exchange = idle_expert_exchange(self.model, recompute=full)
        if exchange is None:
            raise ValueError("the packed micro-batch has no tokens; skip empty micro-batches")
        args = self.model.args
        empty = {name: exchange.new_zeros((0, args.num_layers, args.num_experts_per_tok),
                                          dtype=torch.int64) if name == ROUTES
                 else exchange.new_zeros(0) for name in outputs}
        return {**empty, _PADDING: exchange}

    def forward(self, micro_batches, *, outputs, temperature=1.0):
        check_outputs(self.model, outputs, temperature)
        outs = []
        for i, mb in enumerate(micro_batches):
            with span("forward", micro_batch=i, tokens=mb.num_tokens):
                outs.append(self._outputs(mb.to(self.device), outputs, temperature))
        return [{k: v for k, v in out.items() if k != _PADDING} for out in outs]

    def forward_backward(self, micro_batches, loss_fn, *, outputs, temperature=1.0,
                         final_backward: FinalBackward = contextlib.nullcontext):
        check_outputs(self.model, outputs, temperature)
        results = []
        for i, mb in enumerate(micro_batches):
            mb = mb.to(self.device)
            final = final_backward if i == len(micro_batches) - 1 else contextlib.nullcontext
            if mb.num_tokens == 0:  # a padding micro-batch: backward of the exchanges only
                exchange = self._padding_outputs(outputs)[_PADDING]
                with final():
                    exchange.backward()
                results.append(MicroBatchResult(exchange.detach(), {}))
                continue
            with span("forward", micro_batch=i, tokens=mb.num_tokens):
                loss, metrics = loss_fn(self._outputs(mb, outputs, temperature, training=True),
                                        mb)
            check_loss(loss)
            with final(), span("backward", micro_batch=i, tokens=mb.num_tokens):
                loss.backward()  # frees this micro-batch's activations before the next one
            results.append(MicroBatchResult(loss.detach(), detached(metrics)))
        return results


def make_schedule(built: BuiltModel, mesh: ParallelMesh, *, device) -> Schedule:
    """The schedule for this mesh: a plain loop at pp = 1, else 1F1B (one chunk per rank) or
    interleaved 1F1B (several: vpp > 1), from `rlhf.engine.pipeline`."""
    if mesh.pp_size == 1:
        return NoPipeline(built.model, mesh, tp=built.tp, device=device,
                          cp_attention=built.cp_attention)
    cls = Interleaved1F1B if built.chunks is not None and len(built.chunks) > 1 else OneFOneB
    return cls(built.model, mesh, chunks=built.chunks, tp=built.tp, device=device,
               cp_attention=built.cp_attention)
