"""Optimizer pieces of the engine: LR schedule, weight-decay groups, fp32 master weights, and
gradient collectives (bucketed all-reduce, global norm with TP-replicated params counted once).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from rlhf.config.roles import OptimizerConfig
from rlhf.parallel.collectives import group_rank, group_size



def lr_at(step: int, optim: OptimizerConfig, total_steps: int) -> float:
    """Learning rate of the optimizer step with 0-based index `step`.

    Linear warmup: (step + 1) / warmup_steps * lr for step < warmup_steps (so the first step
    is not wasted at 0). Then constant, or linear / cosine decay from lr at step == warmup_steps
    to min_lr_ratio * lr at step == total_steps (and after).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be at least 1, got {total_steps}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    peak, warmup = optim.lr, optim.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if optim.schedule == "constant":
        return peak
    floor = optim.min_lr_ratio * peak
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if optim.schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    if optim.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {optim.schedule!r}; use constant, linear or cosine")


def decays(param: Tensor) -> bool:
    """Weight decay applies to matrices (linears, embeddings, value head), not to 1-D params
    (norm scales, biases): decaying those pulls norms towards 0 and biases for no benefit."""
    return param.dim() >= 2


def param_groups(params: Sequence[Tensor], weight_decay: float) -> list[dict]:
    """AdamW groups: [decayed matrices, undecayed norms and biases] (empty groups dropped)."""
    groups = [{"params": [p for p in params if decays(p)], "weight_decay": weight_decay},
              {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class MasterParams:
    """The fp32 parameters the optimizer updates, one per model parameter.

    For an fp32 model they are the model's own parameters. For a bf16/fp16 model they are fp32
    copies: each backward's grad is added into the master's fp32 grad by a hook (so grads
    accumulate over micro-batches in fp32) and `copy_to_model` writes the update back.
    """

    def __init__(self, model: nn.Module):
        self.model_params = [p for p in model.parameters() if p.requires_grad]  # tied: once
        self.separate = any(p.dtype != torch.float32 for p in self.model_params)
        if not self.separate:
            self.params = self.model_params
            return
        self.params = [nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        for param, master in zip(self.model_params, self.params):
            param.register_post_accumulate_grad_hook(_accumulate_into(master))

    def grads(self) -> list[Tensor]:
        """Every master grad, materialised as zeros where no backward reached the param."""
        for master in self.params:
            if master.grad is None:
                master.grad = torch.zeros_like(master)
        return [master.grad for master in self.params]

    @torch.no_grad()
    def copy_to_model(self) -> None:
        if self.separate:
            for param, master in zip(self.model_params, self.params):
                param.copy_(master)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Re-read the masters from the model (after loading model weights)."""
        if self.separate:
            for param, master in zip(self.model_params, self.params):
                master.copy_(param)

    def zero_grad(self) -> None:
        for tensor in (*self.model_params, *self.params):
            tensor.grad = None


def _accumulate_into(master: Tensor):
    def hook(param: Tensor) -> None:
        if master.grad is None:
            master.grad = param.grad.float()
        else:
            master.grad.add_(param.grad)
        param.grad = None  # the low-precision grad is never kept across micro-batches
    return hook


def global_grad_norm(grads: Sequence[Tensor], replicated: Sequence[bool], *,
                     tp_group: ProcessGroup | None, mp_group: ProcessGroup | None) -> Tensor:
    """L2 norm of the whole model's gradient, 0-d fp32 (the same on every rank of mp_group).

    TP-sharded grads add their squares on every TP rank; TP-replicated grads (identical on
    all TP ranks) only on TP rank 0, so each is counted once when summing over pp x tp.
    """
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    count_replicated = group_rank(tp_group) == 0
    for grad, rep in zip(grads, replicated):
        if count_replicated or not rep:
            total += grad.detach().float().pow(2).sum()
    if group_size(mp_group) > 1:
        dist.all_reduce(total, group=mp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grads_(grads: Sequence[Tensor], total_norm: Tensor, max_norm: float) -> None:
    """Scale grads by min(1, max_norm / (norm + 1e-6)), as torch's clip_grad_norm_ does."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(coef)
