"""Expert parallelism applied to a built model: each MoE block keeps its E / ep experts.

`apply_ep` runs on the meta model, beside `apply_tp`: every `SparseMoeBlock` drops the experts
other ranks of its ep group hold (the rest keep their global index as their key, hence their HF
names), records which it holds (`expert_placement`, read by the parameter table) and gets the
ep group its forward dispatches tokens over (`rlhf.parallel.expert_parallel`).

Every rank of an ep group must run each layer's exchange as often as the others: a rank with a
padding micro-batch (no tokens; the micro-batch plan gives every dp rank the same count) runs
`idle_expert_exchange` in its place.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlhf.models.moe import SparseMoeBlock
from rlhf.parallel.collectives import group_size
from rlhf.parallel.expert_parallel import ExpertPlacement, experts_forward
from rlhf.parallel.mesh import ParallelMesh


def apply_ep(model: nn.Module, mesh: ParallelMesh) -> None:
    """Keep this rank's experts in every MoE block of `model` (in place) and wire its ep group;
    at ep=1 only the placement is recorded."""
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        placement = ExpertPlacement(block.num_experts, mesh.ep_size,
                                    mesh.ep_rank if mesh.ep_size > 1 else 0)
        for key in [k for k in block.experts if int(k) not in placement.local]:
            del block.experts[key]
        block.expert_placement = placement
        block.ep_group = mesh.ep_group


def idle_expert_exchange(model: nn.Module, *, recompute: bool = False) -> Tensor | None:
    """Take part in every expert-parallel MoE layer's token exchange with no tokens of one's own
    (a padding micro-batch): the other ranks' tokens still reach this rank's experts and go back.
    Returns a 0-d tensor whose backward runs the reverse exchanges (None: no ep > 1 layer).
    `recompute`: the decoder layers recompute in backward (recompute "full"), so each layer's
    exchange is checkpointed too and its forward exchanges run again there, as the others' do.
    Collective over the ep groups, layer after layer in the model's order."""
    out = None
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock) or group_size(block.ep_group) == 1:
            continue
        weight = block.gate.weight
        # requires grad, as a real layer input does: the backward must run both exchanges
        x_TH = weight.new_zeros((0, weight.shape[1])).requires_grad_() if out is None else out
        exchange = functools.partial(_exchange, block)
        if recompute and torch.is_grad_enabled():
            out = checkpoint(exchange, x_TH, use_reentrant=False)
        else:
            out = exchange(x_TH)
    return None if out is None else out.sum()


def _exchange(block: SparseMoeBlock, x_TH: Tensor) -> Tensor:
    none_TK = torch.zeros((0, block.top_k), dtype=torch.int64, device=x_TH.device)
    return x_TH + experts_forward(x_TH, none_TK, x_TH.new_zeros((0, block.top_k)),
                                  run=block.run_local_experts,
                                  placement=block.expert_placement, group=block.ep_group)
