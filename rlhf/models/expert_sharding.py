"""Expert parallelism applied to a built model: each MoE block keeps its E / ep experts.

`apply_ep` runs on the meta model, beside `apply_tp`: every `SparseMoeBlock` drops the experts
other ranks of its ep group hold (the rest keep their global index as their key, hence their HF
names), records which it holds (`expert_placement`, read by the parameter table) and gets the
ep group its forward dispatches tokens over (`rlhf.parallel.expert_parallel`).
"""

from __future__ import annotations

from torch import nn

from rlhf.models.moe import SparseMoeBlock
from rlhf.parallel.expert_parallel import ExpertPlacement
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
