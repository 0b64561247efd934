"""Regional `torch.compile`: the elementwise bodies of the model, fused, one function at a time.

On a GPU the GEMMs of a training step run near the chip's peak; what is left is elementwise
work that eager PyTorch runs as one kernel per operation, each reading and writing the whole
activation: RMSNorm in float32 (about six kernels), RoPE through `rotate_half` (about six per
tensor), the gated activation (two), a residual add, and the vocab head's per-chunk float32
passes (about eight forward, ten backward). The functions here are those bodies as plain
tensor functions, each with an eager and a compiled form (`Fused`). The compiled form is
inductor's fusion of the same arithmetic: one or two kernels, forward and backward.

Why regional, not the whole model: the linears swapped in by tensor parallelism, LoRA, the
expert dispatch and the varlen attention kernels call collectives, custom autograd functions
and host-side layouts, each a graph break or a recompile; the elementwise bodies have none,
so each compiles once into one graph (`fullgraph=True`) and the GEMMs stay the tuned eager
kernels.

Recompilation across packed micro-batches (every one has its own token count): each function
is compiled with dynamic shapes (`dynamic=True`), so the token count is a symbol, not a guard;
a graph is built per dtype, device and `requires_grad` pattern (and per head temperature),
not per shape. Padding to a few buckets would bound it too, at the price of computing the
padding in every layer; dynamic shapes cost nothing at run time for elementwise kernels.

The switch: each role's `compile` config (`auto`: on for CUDA, off on the CPU, where inductor's
first compile of a process costs tens of seconds and the fused kernels gain little; `on`
works on the CPU too). `apply_compile` sets it on a built model; the modules read their
`fused` flag, the vocab head reads the model's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from rlhf.parallel.fusion import Fused


def _rms_norm(x: Tensor, weight: Tensor, eps: float, offset: bool) -> Tensor:
    """transformers' RMSNorm: llama normalises in fp32, casts back, then scales; gemma
    (`offset`) scales by (1 + weight) in fp32, then casts."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def _add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float,
                  offset: bool) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the next norm in one pass."""
    summed = x + delta
    return summed, _rms_norm(summed, weight, eps, offset)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x_THD: Tensor, cos_TD: Tensor, sin_TD: Tensor) -> Tensor:
    return x_THD * cos_TD[:, None, :] + rotate_half(x_THD) * sin_TD[:, None, :]


def _qk_rope(q_THD: Tensor, k_THD: Tensor, cos_TD: Tensor, sin_TD: Tensor,
             q_weight: Tensor | None, k_weight: Tensor | None, eps: float,
             offset: bool) -> tuple[Tensor, Tensor]:
    """RoPE of q and k, after their per-head RMSNorm when the family has one (weights given)."""
    if q_weight is not None and k_weight is not None:
        q_THD, k_THD = _rms_norm(q_THD, q_weight, eps, offset), _rms_norm(k_THD, k_weight, eps,
                                                                           offset)
    return _rope(q_THD, cos_TD, sin_TD), _rope(k_THD, cos_TD, sin_TD)


def _gated(act: Callable[[Tensor], Tensor], gate: Tensor, up: Tensor) -> Tensor:
    """act(gate) * up: the gated MLP's elementwise part (SwiGLU, GeGLU)."""
    return act(gate) * up


rms_norm = Fused(_rms_norm)
add_rms_norm = Fused(_add_rms_norm)
qk_rope = Fused(_qk_rope)
rope = Fused(_rope)
gated = Fused(_gated)


def apply_compile(model: nn.Module, enabled: bool) -> None:
    """Turn the fused (compiled) bodies on or off for every module of `model` that has them
    (a `fused` attribute: the norms, attention, MLPs, and the model itself for its head)."""
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = enabled


def is_fused(model: nn.Module) -> bool:
    """Whether `apply_compile` turned the fused bodies on for `model`."""
    return bool(getattr(model, "fused", False))
