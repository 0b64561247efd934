"""Pipelined schedules over one pipeline rank's model chunks: 1F1B and interleaved 1F1B.

Both share one constructor `(model, mesh, *, chunks, tp, device)` and one executor; they differ
only in the step order (`pipeline_order`). `forward` is the pipelined forward-only pass
(log-probs, values, reward scores). Every rank gets the same micro-batch list, so it knows every
message's shape (`p2p.activation_shape`). Results (outputs, losses, metrics) exist on the last
stage; the other stages return empty lists. `peak_held` records the most (micro-batch, chunk)
activation sets the last run kept alive at once: for 1F1B at most pp - stage; `last_wait_s` the
seconds it spent blocked on messages (its share of the pipeline bubble, for benchmarks; on CUDA
timed with events on the stream, read back only when asked, since NCCL's waits do not block the
host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rlhf.config.schema import CpAttention
from rlhf.engine.loss_fn import (
    FinalBackward,
    LossFn,
    MicroBatchResult,
    Outputs,
    check_loss,
    detached,
)
from rlhf.engine.micro_batch import MicroBatch
from rlhf.engine.pipeline_order import (
    FORWARD,
    Step,
    forward_only_order,
    one_f_one_b_order,
    training_orders,
    units,
)
from rlhf.engine.rank_stream import RankStream, rank_stream, stream_outputs
from rlhf.engine.router_aux import micro_batch_routing, routing_outputs
from rlhf.models.outputs import check_outputs, check_tp_matches
from rlhf.models.tp_sharding import TPState
from rlhf.parallel.mesh import ParallelMesh
from rlhf.parallel.p2p import (
    ACTIVATION,
    GRADIENT,
    Recv,
    Send,
    activation_shape,
    exchange,
    message_tag,
)
from rlhf.parallel.stages import StageChunk, stage_rank
from rlhf.parallel.timing import Stopwatch
from rlhf.trace import span


class PipelineSchedule:
    """The executor shared by the pipelined schedules; subclasses give the training order."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, *,
                 chunks: tuple[StageChunk, ...] | None, tp: TPState, device,
                 cp_attention: CpAttention = "all_gather"):
        if chunks is None or mesh.pp_size < 2:
            raise ValueError("a pipelined schedule needs pp > 1 and a model built for one stage "
                             "(rlhf.models.build.build_model with plan.pp > 1)")
        check_tp_matches(tp, mesh)
        self.model, self.mesh, self.device, self.chunks = model, mesh, device, chunks
        self.vpp, self.pp, self.rank = len(chunks), mesh.pp_size, mesh.pp_rank
        self.num_virtual = self.pp * self.vpp
        self.peak_held = 0
        self._last_wait = Stopwatch("cpu")
        self.tagged = True  # False: untagged messages, matched in posting order as under NCCL
        self._tp, self._sp = tp.tp, tp.sequence_parallel
        self._cp_attention: CpAttention = cp_attention
        self._dtype = next(model.parameters()).dtype

    def training_order(self, num_micro_batches: int) -> tuple[list[Step], bool]:
        """This rank's steps, and whether a forward and the next backward exchange together."""
        raise NotImplementedError

    @property
    def last_wait_s(self) -> float:
        """Seconds the last run spent waiting on messages (on CUDA this waits for the run)."""
        return self._last_wait.seconds

    # ---- the two schedule methods --------------------------------------------------------------

    def forward(self, micro_batches: Sequence[MicroBatch], *, outputs: tuple[str, ...],
                temperature: float = 1.0) -> list[Outputs]:
        """Per-micro-batch outputs on the last stage ([] elsewhere); no activations kept."""
        check_outputs(self.model, outputs, temperature)
        run = _Run(self, self._on_device(micro_batches), loss_fn=None,
                   outputs=outputs, temperature=temperature)
        with torch.no_grad():
            run.execute(forward_only_order(len(micro_batches), pp=self.pp, vpp=self.vpp),
                        pair=False)
        self._last_wait = run.wait
        return [run.outputs[i] for i in sorted(run.outputs)]

    def forward_backward(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *,
                         outputs: tuple[str, ...], temperature: float = 1.0,
                         final_backward: FinalBackward = contextlib.nullcontext
                         ) -> list[MicroBatchResult]:
        """Backward of every micro-batch's loss (last stage's results; [] elsewhere);
        `final_backward()` around each chunk's backward of the last micro-batch."""
        check_outputs(self.model, outputs, temperature)
        run = _Run(self, self._on_device(micro_batches), loss_fn=loss_fn,
                   outputs=outputs, temperature=temperature, final_backward=final_backward)
        order, pair = self.training_order(len(micro_batches))
        run.execute(order, pair=pair)
        self.peak_held, self._last_wait = run.peak_held, run.wait
        return [run.results[i] for i in sorted(run.results)]


    def _on_device(self, micro_batches: Sequence[MicroBatch]) -> list[MicroBatch]:
        empty = [i for i, mb in enumerate(micro_batches) if mb.num_tokens == 0]
        if empty:
            raise ValueError(f"micro-batches {empty} have no tokens; skip empty micro-batches "
                             "(every stage must receive the same list)")
        return [mb.to(self.device) for mb in micro_batches]


class OneFOneB(PipelineSchedule):
    """1F1B (one model chunk per rank): a stage holds at most pp - stage micro-batches."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, *,
                 chunks: tuple[StageChunk, ...] | None, tp: TPState, device,
                 cp_attention: CpAttention = "all_gather"):
        super().__init__(model, mesh, chunks=chunks, tp=tp, device=device,
                         cp_attention=cp_attention)
        if self.vpp != 1:
            raise ValueError(f"1F1B runs one model chunk per rank but this model has {self.vpp} "
                             "(vpp > 1); use Interleaved1F1B")

    def training_order(self, num_micro_batches: int) -> tuple[list[Step], bool]:
        return one_f_one_b_order(num_micro_batches, pp=self.pp, pp_rank=self.rank), False


class Interleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B over vpp model chunks per rank (virtual stages rank, rank + pp, ...)."""

    def training_order(self, num_micro_batches: int) -> tuple[list[Step], bool]:
        orders, pair = training_orders(num_micro_batches, pp=self.pp, vpp=self.vpp)
        return list(orders[self.rank]), pair


class _Run:
    """One pass of a schedule over a micro-batch list: the held activations and the results."""

    def __init__(self, schedule: PipelineSchedule, micro_batches: list[MicroBatch], *,
                 loss_fn: LossFn | None, outputs: tuple[str, ...], temperature: float,
                 final_backward: FinalBackward = contextlib.nullcontext):
        self.s, self.mbs, self.loss_fn = schedule, micro_batches, loss_fn
        self.final_backward = final_backward
        self.output_names, self.temperature = outputs, temperature
        self.pending: list[Send] = []  # the last unit's sends, posted with the next receives
        self.held: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self.peak_held, self.wait = 0, Stopwatch(schedule.device)
        self.outputs: dict[int, Outputs] = {}
        self.results: dict[int, MicroBatchResult] = {}
        self.streams: dict[int, RankStream] = {}

    def execute(self, order: Sequence[Step], *, pair: bool) -> None:
        for unit in units(order, pair=pair):
            wanted = [self._recv_of(step) for step in unit]
            got = iter(self._exchange([r for r in wanted if r is not None]))
            for step, want in zip(unit, wanted):
                received = next(got) if want is not None else None
                forward = step.kind == FORWARD
                step_fn = self.forward_step if forward else self.backward_step
                with span("forward" if forward else "backward", micro_batch=step.micro_batch,
                          chunk=step.chunk, tokens=self.mbs[step.micro_batch].num_tokens):
                    step_fn(step.micro_batch, step.chunk, received)
                self.peak_held = max(self.peak_held, len(self.held))
        self._exchange([])  # the last sends

    def _exchange(self, recvs: list[Recv]) -> list[Tensor]:
        with self.wait(), span("pipeline_wait", sends=len(self.pending), recvs=len(recvs)):
            out = exchange(self.pending, recvs, device=self.s.device, group=self.s.mesh.pp_group,
                           tagged=self.s.tagged)
        self.pending = []
        return out

    def _peer(self, virtual_stage: int) -> int:
        mesh = self.s.mesh
        return mesh.rank_at(dp=mesh.dp_rank, pp=stage_rank(virtual_stage, self.s.pp),
                            tp=mesh.tp_rank)

    def _tag(self, i: int, v: int, direction: int) -> int:
        return message_tag(i, v, direction, num_virtual_stages=self.s.num_virtual)

    def _send(self, tensor: Tensor, i: int, v: int, direction: int) -> None:
        self.pending.append(Send(tensor, dst=self._peer(v), tag=self._tag(i, v, direction)))

    def _recv_of(self, step: Step) -> Recv | None:
        """What `step` receives before its compute: its input, or its output's gradient."""
        s, (kind, i, k) = self.s, step
        chunk = s.chunks[k]
        v = chunk.virtual_stage
        if kind == FORWARD:
            if chunk.has_embedding:
                return None
            shape = activation_shape(self.stream(i).num_tokens, s.model.args.hidden_size,
                                     tp=s._tp, sequence_parallel=s._sp)
            return Recv(shape, s._dtype, src=self._peer(v - 1), tag=self._tag(i, v, ACTIVATION))
        if chunk.has_head:
            return None
        y = self.held[(i, k)][1]
        return Recv(tuple(y.shape), y.dtype, src=self._peer(v + 1), tag=self._tag(i, v, GRADIENT))

    def stream(self, i: int) -> RankStream:
        """Micro-batch i's stream on this rank (its cp shard at cp > 1), built once per run."""
        if i not in self.streams:
            self.streams[i] = rank_stream(self.mbs[i], self.s.mesh, tp=self.s._tp,
                                          sequence_parallel=self.s._sp,
                                          cp_attention=self.s._cp_attention)
        return self.streams[i]

    def forward_step(self, i: int, k: int, received: Tensor | None) -> None:
        s, mb, chunk = self.s, self.mbs[i], self.s.chunks[k]
        v = chunk.virtual_stage
        run = self.stream(i)
        x = run.tokens if chunk.has_embedding else received.requires_grad_(
            torch.is_grad_enabled())
        # A stage sees its own layers only: their routes, never the pooled aux loss.
        routing = micro_batch_routing(s.model, mb, self.output_names, run)
        hidden = s.model.model.run(x, run.position_ids, run.cu_seqlens, run.max_seqlen,
                                   layers=chunk.layer_names, embed=chunk.has_embedding,
                                   norm=chunk.has_head, prefix=run.prefix, layout=run.layout,
                                   routing=routing)
        if not chunk.has_head:
            self._send(hidden, i, v + 1, ACTIVATION)
            if self.loss_fn is not None:
                self.held[(i, k)] = (x, hidden)
            return
        out = stream_outputs(s.model, s.model.head(hidden), run, mb, mesh=s.mesh,
                             outputs=self.output_names, temperature=self.temperature)
        out.update(routing_outputs(s.model, routing, self.output_names, with_aux=False,
                                   stream=run))
        if self.loss_fn is None:
            self.outputs[i] = out
            return
        loss, metrics = self.loss_fn(out, mb)
        check_loss(loss)
        self.results[i] = MicroBatchResult(loss.detach(), detached(metrics))
        self.held[(i, k)] = (x, loss)

    def backward_step(self, i: int, k: int, received: Tensor | None) -> None:
        chunk = self.s.chunks[k]
        x, y = self.held.pop((i, k))
        final = self.final_backward if i == len(self.mbs) - 1 else contextlib.nullcontext
        with final():
            if chunk.has_head:
                y.backward()
            else:
                torch.autograd.backward(y, received)
        if not chunk.has_embedding:
            self._send(x.grad, i, chunk.virtual_stage - 1, GRADIENT)
