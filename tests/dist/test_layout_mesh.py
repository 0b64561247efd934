"""ParallelMesh agrees with Layout, the owner of the rank order: on 4 gloo ranks, every
mesh's coordinates and groups are its Layout's, mapped through the mesh's list of ranks."""

import torch.distributed as dist

from rlhf.parallel.launch import run_distributed
from rlhf.parallel.layout import Layout
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache

MESHES = [  # (ranks, tp, pp, ep, cp)
    ([0, 1, 2, 3], 2, 2, 1, 1), ([0, 1, 2, 3], 1, 2, 1, 1), ([0, 1, 2, 3], 4, 1, 1, 1),
    ([3, 1, 2, 0], 2, 2, 1, 1), ([1, 3], 2, 1, 1, 1), ([2, 0], 1, 2, 1, 1),
    ([0, 1, 2, 3], 1, 1, 2, 1), ([3, 1, 2, 0], 1, 1, 4, 1), ([0, 1, 2, 3], 2, 1, 2, 1),
    ([0, 1, 2, 3], 2, 1, 1, 2), ([3, 1, 2, 0], 1, 2, 1, 2), ([0, 1, 2, 3], 1, 1, 2, 2),
    ([2, 1], 1, 1, 1, 2), ([3, 1, 2, 0], 1, 1, 2, 2),
]
AXES = ("dp", "pp", "cp", "tp", "mp", "embedding", "ep", "edp", "dp_cp", "edp_cp")


def _meshes(rank, world_size):
    cache = ProcessGroupCache()
    out = []
    for ranks, tp, pp, ep, cp in MESHES:
        mesh = ParallelMesh(ranks, tp=tp, pp=pp, ep=ep, cp=cp, cache=cache)
        if not mesh.is_member:
            out.append(None)
            continue
        groups = {}
        for axis in AXES:
            try:
                groups[axis] = list(mesh.group_ranks(axis))
            except ValueError:  # no embedding group off the first and last stage, or at pp=1,
                groups[axis] = None  # and no ep group at ep=1, no cp group at cp=1
        out.append({"layout": mesh.layout, "coordinate": mesh.coordinate, "groups": groups,
                    "next": mesh.rank_at(dp=mesh.dp_rank, pp=(mesh.pp_rank + 1) % mesh.pp_size,
                                         tp=mesh.tp_rank), "grid": mesh.grid.tolist(),
                    "world": dist.get_world_size(), "ep_group_none": mesh.ep_group is None,
                    "expert": (mesh.ep_rank, mesh.edp_rank), "cp_rank": mesh.cp_rank,
                    "cp_group_none": mesh.cp_group is None,
                    "dp_cp_is_dp": mesh.dp_cp_group is mesh.dp_group,
                    "edp_is_dp": mesh.edp_group is mesh.dp_group,
                    "edp_cp_alias": (mesh.edp_cp_group is mesh.edp_group,
                                     mesh.edp_cp_group is mesh.dp_cp_group)})
    return out


def test_mesh_coordinates_and_groups_are_the_layouts():
    built = run_distributed(_meshes, 4, timeout_s=60)
    for rank in range(4):
        for (ranks, tp, pp, ep, cp), got in zip(MESHES, built[rank]):
            if rank not in ranks:
                assert got is None
                continue
            layout = Layout.over(len(ranks), tp=tp, pp=pp, ep=ep, cp=cp)
            position = ranks.index(rank)
            assert got["layout"] == layout
            assert got["coordinate"] == layout.coordinate(position)
            assert got["expert"] == layout.expert_coordinate(position)
            assert got["ep_group_none"] == (ep == 1) and got["edp_is_dp"] == (ep == 1)
            assert got["cp_rank"] == layout.cp_rank(position)
            assert got["cp_group_none"] == (cp == 1) and got["dp_cp_is_dp"] == (cp == 1)
            # the experts' edp x cp group is edp at cp=1, dp_cp at ep=1, its own at both
            assert got["edp_cp_alias"] == (cp == 1, ep == 1)
            for axis in AXES:
                if (axis == "ep" and ep == 1) or (axis == "cp" and cp == 1):
                    assert got["groups"][axis] is None
                    continue
                group = next((g for g in layout.groups(axis) if position in g), None)
                want = None if group is None else [ranks[i] for i in group]
                assert got["groups"][axis] == want, (ranks, tp, pp, rank, axis)
            d, p, t = layout.coordinate(position)
            c = layout.cp_rank(position)
            assert got["next"] == ranks[layout.rank_at(dp=d, pp=(p + 1) % pp, cp=c, tp=t)]
            if c == 0:
                assert got["grid"][d][p][t] == rank
