"""Weights kept as blocks of one tensor, so one GEMM (or one grouped GEMM) reads them as a view.

The weights stay parameters of their own (names, TP and EP splits, checkpoints, export, sync
unchanged); only their storage is shared. `stack_weights` makes them blocks of one tensor,
`stacked_view` checks, by pointer arithmetic and without reading a tensor, that they still are
and returns that tensor as a view. Users: the dense MLP's gate and up (`rlhf.models.gate_up`,
one expert of two parts) and an MoE layer's experts (`rlhf.models.moe`, E experts of gate and
up, and of down). Weights are listed part by part, E each: [gate_0 .. gate_E-1, up_0 ..
up_E-1]; expert e's parts sit one above the other in block e of the (E, parts * O, I) stack.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def stacked_view(weights: Sequence[Tensor], parts: int) -> Tensor | None:
    """The (E, parts * O, I) tensor whose blocks are `weights` ((O, I) each), a view (no
    copy), or None when they are not those blocks of one tensor."""
    first = weights[0]
    if first.dim() != 2 or first.device.type == "meta":
        return None
    rows, cols = first.shape
    per_part = len(weights) // parts
    block = rows * cols * first.element_size()
    base = first.data_ptr()
    # expert e's part p starts block (e * parts + p) of the stack
    starts = [base + (e * parts + part) * block for part in range(parts)
              for e in range(per_part)]
    if ([w.data_ptr() for w in weights] != starts
            or any(w.shape != first.shape or w.stride() != (cols, 1) or w.dtype != first.dtype
                   or w.device != first.device for w in weights)):
        return None
    end = (first.storage_offset() + len(weights) * rows * cols) * first.element_size()
    if end > first.untyped_storage().nbytes():
        return None  # the blocks would run past the first one's storage
    return torch.as_strided(first, (per_part, parts * rows, cols), (parts * rows * cols, cols, 1))


def can_stack(weights: Sequence[Tensor]) -> bool:
    """Whether `weights` can be blocks of one tensor: placed (not meta), one shape, dtype and
    device."""
    first = weights[0]
    return first.device.type != "meta" and all(
        w.shape == first.shape and w.dtype == first.dtype and w.device == first.device
        for w in weights)


@torch.no_grad()
def stack_weights(weights: Sequence[Tensor], parts: int) -> None:
    """Make `weights` (`can_stack`) the blocks of one new (E, parts * O, I) tensor, values
    kept, by swapping each one's `.data`; nothing moves when they already are."""
    if stacked_view(weights, parts) is not None:
        return
    per_part = len(weights) // parts
    rows, cols = weights[0].shape
    stack = torch.empty((per_part, parts * rows, cols), dtype=weights[0].dtype,
                        device=weights[0].device)
    for i, w in enumerate(weights):
        part, e = divmod(i, per_part)
        block = stack[e, part * rows:(part + 1) * rows]
        block.copy_(w)
        w.data = block
