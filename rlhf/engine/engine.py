"""TrainEngine: one role's model shard, optimizer and LR schedule over one ParallelMesh.

Every role (actor, critic, reference, reward model) owns one. Forward-only roles pass
`optim=None`. Training runs a list of packed micro-batches through the mesh's schedule,
backpropagates each micro-batch loss, then syncs gradients:

- TP-replicated parameters whose grad each TP rank holds only in part (tagged
  `sequence_parallel_grad` by the TP plan: norms and row-parallel biases under sequence
  parallelism, the SP value head, Qwen3's q/k norms) have their grads summed over TP;
- data-parallel grads are SUMMED over DP, not averaged: `loss_fn` normalises by global token
  or sequence counts (see `loss_normalizers`), so the per-micro-batch losses of all DP ranks
  already add up to the mini-batch loss.

With pp > 1 the model is this rank's pipeline chunks and the schedule is 1F1B or interleaved
1F1B (`rlhf.engine.pipeline`); a tied embedding has a copy on the first and the last stage
whose grads are summed between them (counted once in the grad norm); metrics are broadcast
from the last stage, so every rank returns the same numbers.

Low-precision (bf16) models train through fp32 master weights that also accumulate the grads
(`optim.MasterParams`); fp32 models are their own masters.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlhf.algorithms.losses import loss_normalizers
from rlhf.config.roles import OptimizerConfig, ParallelConfig
from rlhf.engine import checkpoint as ckpt
from rlhf.engine.micro_batch import MicroBatch
from rlhf.engine.optim import MasterParams, clip_grads_, global_grad_norm, lr_at, param_groups
from rlhf.engine.schedule import LossFn, MicroBatchResult, Outputs, make_schedule
from rlhf.models.parallelize import build_model, export_full_hf_weights, tp_layout
from rlhf.models.transformer import ValueModel
from rlhf.parallel.collectives import all_reduce_tensors, group_size
from rlhf.parallel.mesh import ParallelMesh
from rlhf.parallel.tensor_parallel import SEQUENCE_PARALLEL_GRAD

Head = Literal["lm", "value"]
Recompute = Literal["none", "selective", "full"]
DEFAULT_OUTPUTS = {"lm": ("log_probs", "entropy"), "value": ("values",)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainEngine:
    """A model shard with its optimizer and schedule over `mesh`; see the module docstring."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, *, optim: OptimizerConfig | None,
                 total_steps: int = 1, head: Head | None = None, recompute: Recompute = "none"):
        self.model, self.mesh, self.optim_config = model, mesh, optim
        self.head: Head = head or ("value" if isinstance(model, ValueModel) else "lm")
        self.device = next(model.parameters()).device
        self.total_steps, self.step_count = total_steps, 0
        self.schedule = make_schedule(model, mesh, device=self.device)
        apply_recompute(model, recompute)
        self.optimizer: torch.optim.AdamW | None = None
        self.masters: MasterParams | None = None
        self._grads_synced = False
        if optim is None:
            return
        if total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {total_steps}")
        if any(p.dtype == torch.float16 for p in model.parameters()):
            raise ValueError("float16 training needs loss scaling, which the engine does not do; "
                             "train in bfloat16 or float32")
        self.masters = MasterParams(model)
        sharded = {id(p) for name, p in model.named_parameters() if name in tp_layout(model)}
        self._replicated = [id(p) not in sharded for p in self.masters.model_params]
        self._sequence_parallel = [getattr(p, SEQUENCE_PARALLEL_GRAD, False)
                                   for p in self.masters.model_params]
        # A pipeline's second copy of a shared parameter (the tied LM head on the last stage):
        # its grad is summed with the original's, and the pair counts once in the grad norm.
        names = {id(p): name for name, p in model.named_parameters()}
        shared = model.shared_parameters()
        self._shared = [names[id(p)] in shared or names[id(p)] in shared.values()
                        for p in self.masters.model_params]
        self._copy = [names[id(p)] in shared for p in self.masters.model_params]
        self.optimizer = torch.optim.AdamW(
            param_groups(self.masters.params, optim.weight_decay), lr=lr_at(0, optim, total_steps),
            betas=optim.betas, eps=optim.eps)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, mesh: ParallelMesh,
                        plan: ParallelConfig | None = None, head: Head = "lm",
                        optim: OptimizerConfig | None = None, total_steps: int = 1,
                        dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
                        recompute: Recompute = "none", seed: int = 0) -> TrainEngine:
        """Load this rank's shard of the HF folder `path`; `seed` seeds a fresh value head."""
        plan = plan or ParallelConfig(tp=mesh.tp_size, pp=mesh.pp_size)
        if (plan.tp, plan.pp) != (mesh.tp_size, mesh.pp_size):
            raise ValueError(f"plan has tp={plan.tp} pp={plan.pp} but the mesh has "
                             f"tp={mesh.tp_size} pp={mesh.pp_size}; build them from one config")
        device = resolve_device(device)
        model = build_model(path, mesh=mesh, plan=plan, head=head,
                            dtype=resolve_dtype(dtype, device), device=device, value_head_seed=seed)
        return cls(model, mesh, optim=optim, total_steps=total_steps, head=head,
                   recompute=recompute)

    # ---- compute -----------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, micro_batches: Sequence[MicroBatch], *, outputs: Sequence[str] | None = None,
                temperature: float = 1.0) -> list[Outputs]:
        """Per-token outputs (T,) of every micro-batch, without grad, on the engine's device;
        log-probs and entropy of softmax(logits / temperature), the sampler's distribution.
        With pp > 1 the outputs exist on the last stage; the other stages return []."""
        self.model.eval()
        outs = self.schedule.forward(micro_batches, outputs=self._outputs(outputs),
                                     temperature=temperature)
        return [{k: v.detach() for k, v in out.items()} for out in outs]

    def forward_backward(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *,
                         outputs: Sequence[str] | None = None,
                         temperature: float = 1.0) -> dict[str, float]:
        """Backward of `loss_fn(outputs, mb)` for every micro-batch, then the TP/DP grad sync.

        Returns "loss": the sum over micro-batches and DP ranks (the mini-batch loss when
        loss_fn normalises by global counts), every metric of loss_fn averaged over all
        micro-batches of all DP ranks, and "num_micro_batches" (over all DP ranks).
        """
        self._require_optimizer("forward_backward")
        if self._grads_synced:
            raise RuntimeError("forward_backward was called twice without step() or zero_grad() "
                               "in between; pass all micro-batches of a mini-batch in one call")
        self.model.train()
        results = self.schedule.forward_backward(micro_batches, loss_fn,
                                                 outputs=self._outputs(outputs),
                                                 temperature=temperature)
        self._sync_grads()
        return self._reduce_metrics(results)

    def step(self) -> dict[str, float]:
        """Clip the global grad norm, take one AdamW step at `lr_at(step)`, zero the grads.

        A non-finite grad norm skips the update (and the schedule step) with a warning.
        """
        self._require_optimizer("step")
        grads = self.masters.grads()
        counted = [not copy for copy in self._copy]
        norm = global_grad_norm([g for g, c in zip(grads, counted) if c],
                                [r for r, c in zip(self._replicated, counted) if c],
                                tp_group=self.mesh.tp_group, mp_group=self.mesh.mp_group)
        lr = lr_at(self.step_count, self.optim_config, self.total_steps)
        if not math.isfinite(float(norm)):
            warnings.warn(f"gradient norm is {float(norm)} at step {self.step_count}; "
                          "skipping this update", RuntimeWarning, stacklevel=2)
            self.zero_grad()
            return {"grad_norm": float(norm), "lr": lr}
        if self.optim_config.grad_clip is not None:
            clip_grads_(grads, norm, self.optim_config.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.masters.copy_to_model()
        self.zero_grad()
        self.step_count += 1
        return {"grad_norm": float(norm), "lr": lr}

    def zero_grad(self) -> None:
        """Drop accumulated gradients (model and master)."""
        if self.masters is None:
            self.model.zero_grad(set_to_none=True)
        else:
            self.masters.zero_grad()
        self._grads_synced = False

    def loss_normalizers(self, micro_batches: Sequence[MicroBatch], *,
                         mask_key: str | None) -> tuple[int, int]:
        """(global_tokens, global_seqs) over these micro-batches on every DP rank, counting
        positions where `mb.tensors[mask_key]` is set (None: every position predicting a
        response token): the normalisers `loss_fn` divides by. Collective over DP."""
        counts = [loss_normalizers(mb.tensors[mask_key].bool() if mask_key is not None
                                   else mb.predicts_response_T, mb.packed.cu_seqlens)
                  for mb in micro_batches]
        total = torch.tensor([sum(c[0] for c in counts), sum(c[1] for c in counts)],
                             dtype=torch.int64, device=self.device)
        if group_size(self.mesh.dp_group) > 1:
            dist.all_reduce(total, group=self.mesh.dp_group)
        return int(total[0]), int(total[1])

    # ---- weights -----------------------------------------------------------------------------

    def export_hf_weights(self, *, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
        """Full HF-named tensors in size-bounded buckets (collective over the model group)."""
        return export_full_hf_weights(self.model, self.mesh, bucket_bytes=bucket_bytes)

    def state_tensors(self) -> dict[str, list[Tensor]]:
        """This rank's state by kind: "weights" (model parameters), "grads" (the master
        grads that exist), "masters" (separate fp32 masters), "optimizer" (AdamW state)."""
        masters, optimizer = self.masters, self.optimizer
        return {
            "weights": list(self.model.parameters()),
            "grads": [p.grad for p in masters.params if p.grad is not None] if masters else [],
            "masters": list(masters.params) if masters is not None and masters.separate else [],
            "optimizer": [v for state in optimizer.state.values() for v in state.values()
                          if isinstance(v, Tensor)] if optimizer is not None else [],
        }

    def state_dict(self) -> dict:
        """This rank's model shard, fp32 masters (if separate), optimizer state and step."""
        separate = self.optimizer is not None and self.masters.separate
        return {
            "format_version": ckpt.FORMAT_VERSION, "layout": ckpt.layout(self.mesh),
            "model": self.model.state_dict(),
            "master": [p.detach() for p in self.masters.params] if separate else None,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "step": self.step_count,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned, on an engine built with the same layout."""
        ckpt.check_layout(state, self.mesh, "the state dict")
        self.model.load_state_dict(state["model"])
        self.step_count = int(state["step"])
        if self.optimizer is None:
            return
        if state["optimizer"] is None:
            raise ValueError("the state has no optimizer state (saved by a forward-only engine)")
        self.masters.copy_from_model()
        if self.masters.separate and state["master"] is not None:
            with torch.no_grad():
                for master, saved in zip(self.masters.params, state["master"], strict=True):
                    master.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.zero_grad()

    def save_checkpoint(self, folder: str | Path) -> Path:
        """Write this rank's state under `folder` (collective over the mesh); return the file."""
        return ckpt.save_shard(self.state_dict(), folder, self.mesh)

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore the state `save_checkpoint(folder)` wrote for this rank's coordinate."""
        self.load_state_dict(ckpt.load_shard(folder, self.mesh, device=self.device))

    # ---- internals ---------------------------------------------------------------------------

    def _outputs(self, outputs: Sequence[str] | None) -> tuple[str, ...]:
        return tuple(outputs) if outputs is not None else DEFAULT_OUTPUTS[self.head]

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{what} needs a training engine; this one was built with "
                               "optim=None (forward only)")

    def _sync_grads(self) -> None:
        grads = self.masters.grads()
        sp = [g for g, flag in zip(grads, self._sequence_parallel) if flag]
        all_reduce_tensors(sp, group=self.mesh.tp_group)  # token chunks -> full-stream grads
        all_reduce_tensors(grads, group=self.mesh.dp_group)  # SUM: losses are globally normalised
        if self.mesh.pp_size > 1 and self.mesh.embedding_group is not None:
            # Both stages' copies then step identically: the full model's one tied parameter.
            tied = [g for g, flag in zip(grads, self._shared) if flag]
            all_reduce_tensors(tied, group=self.mesh.embedding_group)
        self._grads_synced = True

    def _reduce_metrics(self, results: list[MicroBatchResult]) -> dict[str, float]:
        """Loss summed; each metric averaged over the micro-batches that report it (all DP)."""
        keys = sorted({k for r in results for k in r.metrics})
        dp_group = self.mesh.dp_group
        if group_size(dp_group) > 1:  # a rank may lack a key (or micro-batches altogether)
            everyone: list[list[str]] = [[] for _ in range(group_size(dp_group))]
            dist.all_gather_object(everyone, keys, group=dp_group)
            keys = sorted({k for ks in everyone for k in ks})
        row = [sum(r.loss for r in results), len(results)]
        for k in keys:
            row += [sum(r.metrics.get(k, 0.0) for r in results),
                    sum(k in r.metrics for r in results)]
        totals = torch.tensor(row, dtype=torch.float64, device=self.device)
        if group_size(dp_group) > 1:
            dist.all_reduce(totals, group=dp_group)
        totals = totals.tolist()
        out = {"loss": totals[0], "num_micro_batches": totals[1]}
        for i, k in enumerate(keys):
            out[k] = totals[2 + 2 * i] / max(totals[3 + 2 * i], 1.0)
        if self.mesh.pp_size > 1:  # results exist on the last stage only
            box = [out]
            last = self.mesh.rank_at(dp=self.mesh.dp_rank, pp=self.mesh.pp_size - 1,
                                     tp=self.mesh.tp_rank)
            dist.broadcast_object_list(box, src=last, group=self.mesh.pp_group)
            out = box[0]
        return out


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None: the CUDA device of this local rank when CUDA is present, else the CPU."""
    if device is not None:
        return torch.device(device)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # Ranks are numbered node by node, so rank % devices is the local rank's device.
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.device("cuda", rank % torch.cuda.device_count())


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA, float32 elsewhere; names as in the role config."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return _DTYPES[dtype]


def apply_recompute(model: nn.Module, mode: Recompute) -> None:
    """Recompute activations in backward: "full" per decoder layer, "selective" attention only."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {mode!r}")
    for layer in model.model.layers.values():
        target = layer if mode == "full" else layer.self_attn
        # An instance attribute, not a wrapper module: parameter names stay HF's.
        target.forward = _checkpointed(target.forward)


def _checkpointed(forward):
    def run(*args):
        if not torch.is_grad_enabled():
            return forward(*args)
        return checkpoint(forward, *args, use_reentrant=False)
    return run
