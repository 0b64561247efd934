"""The dense MLP's gate and up projections as one GEMM, the parameters staying two.

`gate_proj.weight` and `up_proj.weight` stay two parameters with their own names, TP split,
checkpoint entries, export and weight sync. `pair_linears` (through
`rlhf.models.transformer.pair_gate_up`, run once the engine holds the placed model) makes them
the two row halves of one contiguous (2*I_local, H) tensor, gate rows first. While they are
(`paired_weight` checks, cheaply, at every forward), `GateUpMatmul` views the pair as one
weight without a copy: one GEMM forward, one for the input's grad and one for the pair's grad,
returned as its two halves. The optimizer updates parameters in place, a DCP load copies into
them, and offloading restores the shared storage (`rlhf.engine.offload`), so the pairing
lasts; whatever breaks it (a `.data` swap, LoRA, a bias) makes the forward run the two linears
as before: never other numbers, only the slower path.

Biases (`mlp_bias` models) are not paired: such MLPs keep the two linears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlhf.models.weight_stacks import can_stack, stack_weights, stacked_view
from rlhf.parallel.tensor_parallel import ColumnParallelLinear


def _plain(linear: nn.Module) -> bool:
    """A linear whose forward is x Wᵀ on (this rank's rows of) its weight: no bias, no
    adapter, no gathered output."""
    if type(linear) is nn.Linear:
        return linear.bias is None
    if type(linear) is ColumnParallelLinear:
        return linear.bias is None and not linear.gather_output
    return False


def _weight(linear: nn.Module) -> Tensor:
    weight = linear.weight
    assert isinstance(weight, Tensor)
    return weight


def _same_input(gate: nn.Module, up: nn.Module) -> bool:
    """Whether the two linears see the same input (same TP group and sequence parallelism)."""
    if isinstance(gate, ColumnParallelLinear) and isinstance(up, ColumnParallelLinear):
        return gate.group is up.group and gate.sequence_parallel == up.sequence_parallel
    return type(gate) is type(up)


def paired_weight(gate_w: Tensor, up_w: Tensor) -> Tensor | None:
    """The (2I, H) weight whose halves are `gate_w` and `up_w`, a view (no copy), or None
    when they are not adjacent halves of one storage."""
    stack = stacked_view([gate_w, up_w], 2)
    return None if stack is None else stack[0]


class GateUpMatmul(torch.autograd.Function):
    """(x, gate_w, up_w) -> x [gate_w; up_w]ᵀ, the two weights adjacent halves of one storage."""

    @staticmethod
    def forward(ctx, x: Tensor, gate_w: Tensor, up_w: Tensor) -> Tensor:
        weight = paired_weight(gate_w, up_w)
        assert weight is not None, "GateUpMatmul needs paired weights (see paired_weight)"
        ctx.save_for_backward(x, gate_w, up_w)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor):
        grad_out = grad_outputs[0]
        x, gate_w, up_w = ctx.saved_tensors
        weight = paired_weight(gate_w, up_w)
        assert weight is not None
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            grad_gate, grad_up = grad_w.chunk(2, dim=0)
        return grad_x, grad_gate, grad_up


def gate_up(gate: nn.Module, up: nn.Module, x_TH: Tensor) -> tuple[Tensor, Tensor]:
    """(gate(x), up(x)): one GEMM when the two weights are paired, else the two linears."""
    if not (_plain(gate) and _plain(up) and _same_input(gate, up)
            and paired_weight(_weight(gate), _weight(up)) is not None):
        return gate(x_TH), up(x_TH)
    if isinstance(gate, ColumnParallelLinear):
        x_TH = gate.gather_input(x_TH)
    gate_TI, up_TI = GateUpMatmul.apply(x_TH, _weight(gate), _weight(up)).chunk(2, dim=-1)
    return gate_TI, up_TI


@torch.no_grad()
def pair_linears(gate: nn.Module, up: nn.Module) -> bool:
    """Make `gate` and `up`'s weights the halves of one (2I, H) tensor (values kept; nothing
    moves when they already are); whether they are paired. Linears with LoRA, a bias or meta
    weights are left alone (they run apart)."""
    if not (_plain(gate) and _plain(up) and _same_input(gate, up)):
        return False
    weights = [_weight(gate), _weight(up)]
    if not can_stack(weights):
        return False
    stack_weights(weights, 2)
    return True
