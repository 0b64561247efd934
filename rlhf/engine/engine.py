"""TrainEngine: one role's model shard, optimizer and LR schedule over one ParallelMesh.

Every role (actor, critic, reference, reward model) owns one. Forward-only roles pass
`optim=None`. Training runs a list of packed micro-batches through the mesh's schedule,
backpropagates each micro-batch loss into one flat fp32 grad buffer, then syncs the grads as
the model's `ParamTable` says (`rlhf.engine.grads`: partial grads summed over TP, pipeline
ties summed, DP grads SUMMED, not averaged: `loss_fn` normalises by global token or sequence
counts, see `loss_normalizers`, so the per-micro-batch losses of all DP ranks already add up
to the mini-batch loss).

The optimizer is AdamW on flat fp32 state laid out by `rlhf.engine.zero`. With ZeRO-1
(`optim.distributed`, on by default when dp > 1) the master weights and moments are split
over the DP group: grads are reduce-scattered into the owning shard, the shard steps, and the
updated parameters are all-gathered back. Otherwise every DP rank holds and steps the whole
state. At ep > 1 the routed experts' parameters have their own grad buffer and optimizer over
the expert-data-parallel group (ZeRO-1 there), the rest over DP. Low-precision (bf16) models
train through fp32 master weights; fp32 models are their own masters. Only trainable
parameters get grads and optimizer state: with LoRA adapters (`rlhf.models.lora`) the
frozen base is outside the grad buffers, the grad sync and ZeRO-1.

With cp > 1 every rank of a dp replica receives the same micro-batches and runs its context
shard of each (`rlhf.engine.rank_stream`); the outputs handed to `loss_fn` are gathered back
to whole packs, so losses, normalisers (over dp) and metrics are those of cp = 1, and the
grads are summed and ZeRO-1 sharded over dp × cp (`grads.sync_group`).

With pp > 1 the model is this rank's pipeline chunks and the schedule is 1F1B or interleaved
1F1B (`rlhf.engine.pipeline`); metrics are broadcast from the last stage, so every rank
returns the same numbers.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor

import rlhf.engine.checkpoint as ckpt
from rlhf.algorithms.losses import normalizer_counts
from rlhf.config.schema import (
    AUTO_DTYPE,
    Compile,
    Dtype,
    LoraConfig,
    OptimizerConfig,
    ParallelConfig,
)
from rlhf.engine.grads import (
    GradBuffer,
    GradSync,
    clip_,
    gather_grads,
    grad_norm,
    scatters_grads,
    sync_group,
)
from rlhf.engine.metrics import reduce_metrics
from rlhf.engine.micro_batch import MicroBatch
from rlhf.engine.optim import ShardedAdamW, lr_at
from rlhf.engine.recompute import Recompute, apply_recompute
from rlhf.engine.router_aux import router_aux_coef, with_router_aux
from rlhf.engine.schedule import LossFn, Outputs, make_schedule
from rlhf.engine.zero import BUCKET_NUMEL, num_shards, partition
from rlhf.models.build import BuiltModel, build_model
from rlhf.models.export import export_full_hf_weights, export_nbytes, gather_full_grads
from rlhf.models.fused import apply_compile
from rlhf.models.moe import stack_experts
from rlhf.models.param_table import ParamTable
from rlhf.models.transformer import ValueModel, pair_gate_up
from rlhf.parallel.collectives import group_rank, group_size
from rlhf.parallel.expert_parallel import timed_all_to_all
from rlhf.parallel.fusion import compile_enabled
from rlhf.parallel.mesh import ParallelMesh
from rlhf.parallel.timing import Stopwatch

Head = Literal["lm", "value"]
DEFAULT_OUTPUTS = {"lm": ("log_probs", "entropy"), "value": ("values",)}
# The role config's dtype names (config.schema.Dtype) as torch dtypes, and back (vLLM's args).
DTYPES = {name: getattr(torch, name) for name in get_args(Dtype) if name != AUTO_DTYPE}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class _ParamSet:
    """Parameters that sync and step together (the dense ones over dp; at ep > 1 the routed
    experts over edp): their table indices, grads, shard rank, optimizer, table and sync."""

    def __init__(self, ids: list[int], grads: GradBuffer, rank: int, optimizer: ShardedAdamW,
                 table: ParamTable, sync: GradSync):
        self.ids, self.grads, self.rank, self.optimizer = ids, grads, rank, optimizer
        self.table, self.expert, self.sync = table, grads.expert, sync


class TrainEngine:
    """A model shard with its optimizer and schedule over `mesh`; see the module docstring.

    `built`: the model with its parameter table, TP state and pipeline chunks (`build_model`,
    or `BuiltModel.unsharded` for a whole model).
    `bucket_numel`: elements per grad / ZeRO-1 bucket (`rlhf.engine.zero`).
    `scatter_grads`: ZeRO-1 reduce-scatters DP grads rather than all-reducing them (None:
    `grads.scatters_grads` decides from the backend).
    `router_aux_loss_coef`: an MoE model's load-balancing loss weight in `forward_backward`
    (None: the checkpoint's; `rlhf.engine.router_aux`).
    `compile`: the elementwise bodies compiled (`rlhf.models.fused`; auto = on CUDA only).
    """

    def __init__(self, built: BuiltModel, mesh: ParallelMesh, *,
                 optim: OptimizerConfig | None, total_steps: int = 1, head: Head | None = None,
                 recompute: Recompute = "none", bucket_numel: int = BUCKET_NUMEL,
                 scatter_grads: bool | None = None, router_aux_loss_coef: float | None = None,
                 compile: Compile = "auto"):
        model = built.model
        if [e.name for e in built.table] != [name for name, _ in model.named_parameters()]:
            raise ValueError("the parameter table does not describe this model; pass the "
                             "BuiltModel build_model returned")
        self.model, self.mesh, self.optim_config = model, mesh, optim
        self.table, self.tp = built.table, built.tp
        self.head: Head = head or ("value" if isinstance(model, ValueModel) else "lm")
        self.device = next(model.parameters()).device
        self.total_steps, self.step_count = total_steps, 0
        self.schedule = make_schedule(built, mesh, device=self.device)
        self._all_to_all = Stopwatch(self.device)  # expert all-to-alls (take_all_to_all_s)
        self.router_aux_loss_coef = router_aux_coef(model.args, router_aux_loss_coef,
                                                    pp=mesh.pp_size)
        apply_recompute(model, recompute)
        apply_compile(model, compile_enabled(compile, self.device))
        # The model is sharded, cast and placed: each dense MLP's gate and up weights become
        # halves of one tensor, for one GEMM (rlhf.models.gate_up), and each MoE layer's local
        # experts blocks of two stacks, for grouped GEMMs without copies (rlhf.models.moe);
        # values and names unchanged.
        pair_gate_up(model)
        stack_experts(model)
        # The one list of what trains: [dense] or, at ep > 1, [dense, experts]; [] forward only.
        self._sets: list[_ParamSet] = []
        self._grads_synced = False
        # Stream tokens of the mini-batch over DP, counted by loss_normalizers' all-reduce for
        # the router aux loss of the forward_backward that follows: (micro-batch ids, count).
        self._counted_tokens: tuple[tuple[int, ...], int] | None = None
        if optim is None:
            return
        if total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {total_steps}")
        if any(p.dtype == torch.float16 for p in model.parameters()):
            raise ValueError("float16 training needs loss scaling, which the engine does not do; "
                             "train in bfloat16 or float32")
        params = [p for _, p in model.named_parameters()]  # the table's order; a tie once
        # Only trainable parameters get grads and optimizer state: under LoRA the frozen base
        # is outside the grad buffers, the ZeRO-1 partitions and the grad sync.
        trainable = {i for i, e in enumerate(self.table) if e.trainable}
        if not trainable:
            raise ValueError("the model has no trainable parameters; build a forward-only "
                             "engine (optim=None) or unfreeze some")
        # At ep > 1 the routed experts get a buffer and optimizer of their own over the
        # expert-data-parallel group (rlhf.engine.grads); dense params keep the dp group.
        expert_ids = [i for i in self.table.expert_indices(ep=mesh.ep_size) if i in trainable]
        dense_ids = sorted(trainable - set(expert_ids))
        for ids, expert in ((dense_ids, False), (expert_ids, True)):
            if expert and not ids:
                continue
            group = sync_group(mesh, expert=expert)
            shards = num_shards(group_size(group), optim.distributed)
            part = partition([params[i].numel() for i in ids], shards, bucket_numel=bucket_numel)
            self.table = self.table.with_partition(part, only=ids)  # touches `ids` only
            scatter = scatters_grads(part, group) if scatter_grads is None else scatter_grads
            grads = GradBuffer([params[i] for i in ids], part, device=self.device,
                               scatter=scatter and shards > 1, expert=expert)
            rank = group_rank(group) if shards > 1 else 0
            optimizer = ShardedAdamW([params[i] for i in ids], part, rank=rank, config=optim,
                                     dp_group=group, device=self.device)
            table = ParamTable(tuple(self.table.entries[i] for i in ids))
            sync = GradSync(grads, table, mesh, rank=rank, overlap=optim.overlap_grad_reduce)
            self._sets.append(_ParamSet(ids, grads, rank, optimizer, table, sync))

    # ---- the parameter sets, by role (views of self._sets) -----------------------------------

    @property
    def optimizer(self) -> ShardedAdamW | None:
        """The dense parameters' optimizer; None for a forward-only engine."""
        dense = self._set(expert=False)
        return dense.optimizer if dense is not None else None

    @property
    def grads(self) -> GradBuffer | None:
        """The dense parameters' grad buffer; None for a forward-only engine."""
        dense = self._set(expert=False)
        return dense.grads if dense is not None else None

    @property
    def expert_grads(self) -> GradBuffer | None:
        """The routed experts' own grad buffer (over edp) at ep > 1; None otherwise."""
        experts = self._set(expert=True)
        return experts.grads if experts is not None else None

    @property
    def distributed(self) -> bool:
        """Whether ZeRO-1 shards the dense optimizer state over dp."""
        return self.grads is not None and self.grads.part.shards > 1

    def _set(self, *, expert: bool) -> _ParamSet | None:
        return next((s for s in self._sets if s.expert == expert), None)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, mesh: ParallelMesh,
                        parallel: ParallelConfig | None = None, head: Head = "lm",
                        optim: OptimizerConfig | None = None, total_steps: int = 1,
                        dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
                        recompute: Recompute = "none", seed: int = 0,
                        lora: LoraConfig | None = None,
                        router_aux_loss_coef: float | None = None,
                        compile: Compile = "auto") -> TrainEngine:
        """Load this rank's shard of the HF folder `path`; `seed` seeds a fresh value head and
        the adapters of `lora` (when enabled: the base is frozen, only adapters train)."""
        parallel = parallel or ParallelConfig(tp=mesh.tp_size, pp=mesh.pp_size, ep=mesh.ep_size,
                                              cp=mesh.cp_size)
        if (parallel.tp, parallel.cp, parallel.pp) != (mesh.tp_size, mesh.cp_size, mesh.pp_size):
            raise ValueError(f"the parallel config has tp={parallel.tp} cp={parallel.cp} "
                             f"pp={parallel.pp} but the mesh has tp={mesh.tp_size} "
                             f"cp={mesh.cp_size} pp={mesh.pp_size}; build them from one config")
        device = resolve_device(device)
        built = build_model(path, mesh=mesh, parallel=parallel, head=head,
                            dtype=resolve_dtype(dtype, device), device=device,
                            value_head_seed=seed, lora=lora)
        return cls(built, mesh, optim=optim, total_steps=total_steps, head=head,
                   recompute=recompute, router_aux_loss_coef=router_aux_loss_coef,
                   compile=compile)

    # ---- compute -----------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, micro_batches: Sequence[MicroBatch], *, outputs: Sequence[str] | None = None,
                temperature: float = 1.0) -> list[Outputs]:
        """Per-token outputs (T,) of every micro-batch, without grad, on the engine's device;
        log-probs and entropy of softmax(logits / temperature), the sampler's distribution.
        With pp > 1 the outputs exist on the last stage; the other stages return []."""
        self.model.eval()
        with timed_all_to_all(self._all_to_all):
            outs = self.schedule.forward(micro_batches, outputs=self._outputs(outputs),
                                         temperature=temperature)
        return [{k: v.detach() for k, v in out.items()} for out in outs]

    def forward_backward(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *,
                         outputs: Sequence[str] | None = None,
                         temperature: float = 1.0) -> dict[str, float]:
        """Backward of `loss_fn(outputs, mb)` for every micro-batch, then the TP/DP grad sync.

        Returns "loss": the sum over micro-batches and DP ranks (the mini-batch loss when
        loss_fn normalises by global counts), every metric of loss_fn averaged over all
        micro-batches of all DP ranks, and "num_micro_batches" (over all DP ranks). An MoE
        model adds its router load-balancing loss to `loss_fn`'s and reports "router_aux_loss".
        """
        self._require_optimizer("forward_backward")
        if self._grads_synced:
            raise RuntimeError("forward_backward was called twice without step() or zero_grad() "
                               "in between; pass all micro-batches of a mini-batch in one call")
        self.model.train()
        if self.model.args.is_moe:
            loss_fn = with_router_aux(loss_fn, coef=self.router_aux_loss_coef,
                                      total_tokens=self._global_tokens(micro_batches))
        self._counted_tokens = None
        for param_set in self._sets:
            param_set.sync.reset()
        with timed_all_to_all(self._all_to_all):
            results = self.schedule.forward_backward(micro_batches, loss_fn,
                                                     outputs=self._outputs(outputs),
                                                     temperature=temperature,
                                                     final_backward=self._final_backward)
        self.sync_grads()
        return reduce_metrics(results, self.mesh, device=self.device)

    def sync_grads(self) -> None:
        """Sum the accumulated grads over TP, pipeline ties and DP (`rlhf.engine.grads`);
        `forward_backward` calls it. Collective over the role's ranks."""
        self._require_optimizer("sync_grads")
        for param_set in self._sets:
            param_set.sync.finish()
        self._grads_synced = True

    @contextlib.contextmanager
    def _final_backward(self) -> Iterator[None]:
        """Around a backward whose grads are the last of the mini-batch (the schedule enters
        it for each model chunk's backward of the last micro-batch): buckets whose grads are
        all final start their DP sum (`GradSync`, with optim.overlap_grad_reduce)."""
        for param_set in self._sets:
            param_set.grads.final = True
        try:
            with torch.profiler.record_function("final_backward"):  # a span in traces
                yield
        finally:
            for param_set in self._sets:
                param_set.grads.final = False

    def step(self) -> dict[str, float]:
        """Clip the global grad norm, take one AdamW step at `lr_at(step)`, zero the grads.

        A non-finite grad norm skips the update (and the schedule step) with a warning.
        """
        self._require_optimizer("step")
        norm = grad_norm([(p.grads, p.table, p.rank) for p in self._sets], self.mesh)
        lr = lr_at(self.step_count, self.optim_config, self.total_steps)
        norm_value = float(norm)  # the step's one read: skipping needs it on the host
        if not math.isfinite(norm_value):
            warnings.warn(f"gradient norm is {norm_value} at step {self.step_count}; "
                          "skipping this update", RuntimeWarning, stacklevel=2)
            self.zero_grad()
            return {"grad_norm": norm_value, "lr": lr}
        for param_set in self._sets:
            if self.optim_config.grad_clip is not None:
                clip_(param_set.grads, norm, self.optim_config.grad_clip, rank=param_set.rank)
            param_set.optimizer.step(param_set.grads.flat, lr=lr, step=self.step_count + 1)
            param_set.optimizer.copy_to_model()
        self.zero_grad()
        self.step_count += 1
        return {"grad_norm": norm_value, "lr": lr}

    def zero_grad(self) -> None:
        """Drop accumulated gradients."""
        self.model.zero_grad(set_to_none=True)
        for param_set in self._sets:
            param_set.grads.zero_()
        self._grads_synced = False

    def state_tensors(self) -> dict[str, list[Tensor]]:
        """Every tensor whose storage this rank holds, by kind; the same objects for the
        engine's life (offloading may swap their `.data`), all allocated at construction.

        "weights": the model parameters (a tied pair once). "grads": the flat fp32 grad
        buffer of a training engine (accumulated by backward, valid after forward_backward,
        zeroed by step; padded, see `rlhf.engine.zero`), [] forward-only. "masters": the fp32
        master shard of a bf16 model ([] for fp32 models and forward-only engines).
        "optimizer": the two Adam moment shards (the step count is a Python int).
        """
        out = {"weights": list(self.model.parameters()), "grads": [], "masters": [],
               "optimizer": []}
        for param_set in self._sets:
            out["grads"].append(param_set.grads.flat)
            for kind, tensors in param_set.optimizer.tensors().items():
                out[kind] = out[kind] + tensors
        return out

    def full_grads(self) -> dict[str, Tensor]:
        """HF name -> full synced gradient (fp32 values in the parameter dtype), for checks
        after `forward_backward` / `sync_grads`. Collective over the role's ranks."""
        self._require_optimizer("full_grads")
        try:
            for param_set in self._sets:
                flat, part = gather_grads(param_set.grads, self.mesh), param_set.grads.part
                for i, param in enumerate(param_set.grads.params):
                    start = part.offsets[i]
                    param.grad = flat[start:start + part.numels[i]].view(param.shape).to(
                        param.dtype)
            return gather_full_grads(self.model, self.table, self.mesh)
        finally:
            for param in self.model.parameters():
                param.grad = None

    def loss_normalizers(self, micro_batches: Sequence[MicroBatch], *,
                         mask_key: str | None) -> tuple[int, int]:
        """(global_tokens, global_seqs) over these micro-batches on every DP rank, counting
        positions where `mb.tensors[mask_key]` is set (None: every position predicting a
        response token): the normalisers `loss_fn` divides by. Collective over DP."""
        # Summed where the micro-batches are (the host, usually), then moved once. The stream
        # tokens ride along for the router aux loss of the forward_backward that follows.
        counts = []
        for mb in micro_batches:
            valid = normalizer_counts(mb.tensors[mask_key].bool() if mask_key is not None
                                      else mb.predicts_response_T, mb.packed.cu_seqlens)
            counts.append(torch.cat([valid, valid.new_tensor([mb.num_tokens])]))
        total = (torch.stack(counts).sum(0) if counts
                 else torch.zeros(3, dtype=torch.int64)).to(self.device)
        if group_size(self.mesh.dp_group) > 1:
            dist.all_reduce(total, group=self.mesh.dp_group)
        tokens, seqs, stream = total.tolist()  # one read for the whole mini-batch
        self._counted_tokens = (tuple(map(id, micro_batches)), stream)
        return tokens, seqs

    # ---- weights -----------------------------------------------------------------------------

    def export_hf_weights(self, *, bucket_bytes: int, select: Callable[[str], bool] | None = None
                          ) -> Iterator[list[tuple[str, Tensor]]]:
        """Full HF-named tensors in size-bounded buckets (collective over the model group);
        only those `select(name)` accepts when given."""
        return export_full_hf_weights(self.model, self.table, self.mesh,
                                      bucket_bytes=bucket_bytes, select=select)

    def export_nbytes(self, *, select: Callable[[str], bool] | None = None) -> int:
        """Bytes `export_hf_weights` sends with the same `select` (collective over pp)."""
        return export_nbytes(self.model, self.table, self.mesh, select=select)

    def state_dict(self) -> dict:
        """This rank's model shard, optimizer state (its ZeRO-1 shard, or all) and step; at
        ep > 1 the routed experts (weights, optimizer) apart under "experts"."""
        out: dict = {"step": self.step_count}
        for key, keep, param_set in self._state_parts():
            section = {**ckpt.header(self.mesh),
                       "model": ckpt.model_state(self.model, keep=keep),  # LoRA: adapters only
                       "optimizer": param_set.optimizer.state_dict() if param_set else None}
            if key is None:
                out.update(section)
            else:
                out[key] = section
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned, on an engine built with the same layout."""
        parts = [(state if key is None else state[key], _where(key), keep, param_set)
                 for key, keep, param_set in self._state_parts()]
        for section, where, keep, _ in parts:
            ckpt.check_layout(section, self.mesh, where)
            ckpt.load_model_state(self.model, section["model"], where, keep=keep)
        self.step_count = int(state["step"])
        for section, where, _, param_set in parts:  # after the weights: masters copy them
            if param_set is None:
                continue
            if section["optimizer"] is None:
                raise ValueError(f"{where} has no optimizer state (saved by a forward-only "
                                 "engine)")
            param_set.optimizer.copy_from_model()
            param_set.optimizer.load_state_dict(section["optimizer"], where=where)
        if self._sets:
            self.zero_grad()

    def save_checkpoint(self, folder: str | Path) -> Path:
        """Write this rank's part of the engine state under `folder` as global tensors
        (`rlhf.engine.checkpoint`: DCP, loadable into any layout; collective over the mesh);
        return the checkpoint's engine.json."""
        return ckpt.save_engine(folder, model=self.model, table=self.table, mesh=self.mesh,
                                optimizers=self._optimizers(), step=self.step_count)

    def start_checkpoint(self, folder: str | Path, *, background: bool) -> ckpt.EngineWrite:
        """`save_checkpoint`, its data written in a thread from a host copy with `background`
        (training may go on); every rank then calls `finish()` on the result (collective)."""
        return ckpt.start_engine_save(folder, model=self.model, table=self.table,
                                      mesh=self.mesh, optimizers=self._optimizers(),
                                      step=self.step_count, background=background)

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore the state a `save_checkpoint(folder)` wrote, in whatever layout (tp, pp,
        vpp, dp, ep, ZeRO-1) it was saved. A format-2 checkpoint (files per (pp, tp)
        coordinate, from before DCP) loads at its own tp, pp and ep only, its optimizer state
        resharded over dp."""
        if ckpt.checkpoint_format(folder) == ckpt.FORMAT_VERSION:
            self.step_count = ckpt.load_engine(folder, model=self.model, table=self.table,
                                               mesh=self.mesh, optimizers=self._optimizers())
            if self._sets:
                self.zero_grad()
            return
        shards = {s.expert: s.grads.part.shards for s in self._sets}
        self.load_state_dict(ckpt.load_shard(folder, self.mesh, shards=shards.get(False, 1),
                                             expert_shards=shards.get(True, 1)))

    def _optimizers(self) -> list[tuple[list[int], ShardedAdamW]]:
        """(table indices, optimizer) of each parameter set, for the checkpoint."""
        return [(s.ids, s.optimizer) for s in self._sets]

    def take_all_to_all_s(self) -> float:
        """Seconds this rank spent in expert-parallel all-to-alls since the last call (forwards,
        backwards); 0 without ep. On CUDA, waits for the last one to finish."""
        seconds = self._all_to_all.seconds
        self._all_to_all = Stopwatch(self.device)
        return seconds

    # ---- internals ---------------------------------------------------------------------------

    def _global_tokens(self, micro_batches: Sequence[MicroBatch]) -> int:
        """Stream tokens of these micro-batches summed over the DP ranks: `loss_normalizers`'
        count when it just counted them, else collective over DP."""
        if (self._counted_tokens is not None
                and self._counted_tokens[0] == tuple(map(id, micro_batches))):
            return max(self._counted_tokens[1], 1)
        total = torch.tensor([sum(mb.num_tokens for mb in micro_batches)], device=self.device)
        if group_size(self.mesh.dp_group) > 1:
            dist.all_reduce(total, group=self.mesh.dp_group)
        return max(int(total.item()), 1)

    def _outputs(self, outputs: Sequence[str] | None) -> tuple[str, ...]:
        return tuple(outputs) if outputs is not None else DEFAULT_OUTPUTS[self.head]

    def _state_parts(self) -> list[tuple[str | None, Callable[[str], bool] | None,
                                         _ParamSet | None]]:
        """(key in the state dict, None = top level; which model-state names; the parameter
        set whose optimizer state goes with them) of the dense part and, at ep > 1, of the
        routed experts under "experts"."""
        if self._expert_filter(experts=True) is None:
            return [(None, None, self._set(expert=False))]
        return [(None, self._expert_filter(experts=False), self._set(expert=False)),
                (ckpt.EXPERTS_KEY, self._expert_filter(experts=True), self._set(expert=True))]

    def _expert_filter(self, *, experts: bool) -> Callable[[str], bool] | None:
        """At ep > 1, which model-state names a checkpoint keeps per ep rank (`experts`) or in
        the (pp, tp) file (the rest); None at ep=1, where every rank holds every expert."""
        ids = self.table.expert_indices(ep=self.mesh.ep_size)
        if not ids:
            return None
        names = {self.table.entries[i].name for i in ids}
        return (lambda name: name in names) if experts else (lambda name: name not in names)

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{what} needs a training engine; this one was built with "
                               "optim=None (forward only)")


def _where(key: str | None) -> str:
    return "the state dict" if key is None else f"the state dict's {key}"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None: this process's current CUDA device when CUDA is present, else the CPU.

    A worker passes its WorkerContext.device, and sets it current, so None never guesses a rank's
    GPU from its number (rlhf.controller.device owns that choice)."""
    if device is not None:
        return torch.device(device)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA, float32 elsewhere; names as in the role config."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == AUTO_DTYPE:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(get_args(Dtype))}, got {dtype!r}")
    return DTYPES[dtype]
