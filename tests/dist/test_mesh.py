"""ParallelMesh over 4 ranks: coordinates, groups and pipeline neighbours for several layouts,
several meshes in one process sharing groups through one ProcessGroupCache, and validation."""

import itertools

import pytest
import torch
import torch.distributed as dist

from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache

WORLD = 4
LAYOUTS = [  # built in this order by every rank, with one cache
    dict(ranks=[0, 1, 2, 3], tp=2, pp=2),
    dict(ranks=[0, 1, 2, 3], tp=1, pp=2),  # dp inferred: 2
    dict(ranks=[0, 1, 2, 3], tp=4),
    dict(ranks=[0, 1, 2, 3], dp=4),
    dict(ranks=[0, 1, 2, 3], tp=2, dp=2),
    dict(ranks=[3, 1, 2, 0], tp=2, pp=2),  # any order: group rank follows mesh position
    dict(ranks=[1, 3], tp=2),  # ranks 0 and 2 are not members
    dict(ranks=[2, 0], pp=2),
]
AXES = ("dp", "pp", "tp", "mp")


def _expected(ranks, tp=1, pp=1, dp=None):
    """Coordinates and groups by plain loops, independent of the mesh's tensor reshapes."""
    dp = dp or len(ranks) // (tp * pp)
    at, coord = {}, {}
    for i, (d, p, t) in enumerate(itertools.product(range(dp), range(pp), range(tp))):
        at[d, p, t] = ranks[i]
        coord[ranks[i]] = (d, p, t)
    out = {}
    for r, (d, p, t) in coord.items():
        out[r] = {
            "coordinate": (d, p, t),
            "dp": [at[x, p, t] for x in range(dp)],
            "pp": [at[d, x, t] for x in range(pp)],
            "tp": [at[d, p, x] for x in range(tp)],
            "mp": [at[d, x, y] for x in range(pp) for y in range(tp)],
            "next": at[d, (p + 1) % pp, t],
            "prev": at[d, (p - 1) % pp, t],
            "first": p == 0,
            "last": p == pp - 1,
        }
    return out


def _inspect(mesh):
    if not mesh.is_member:
        try:
            mesh.tp_rank
        except ValueError as e:
            return {"member": False, "error": str(e), "describe": mesh.describe()}
        return {"member": False, "error": None, "describe": mesh.describe()}
    d, p, t = mesh.coordinate
    info = {"member": True, "coordinate": (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank),
            "next": mesh.rank_at(dp=d, pp=(p + 1) % mesh.pp_size, tp=t),
            "prev": mesh.rank_at(dp=d, pp=(p - 1) % mesh.pp_size, tp=t),
            "first": p == 0, "last": p == mesh.pp_size - 1,
            "describe": mesh.describe(), "sizes": (mesh.dp_size, mesh.pp_size, mesh.tp_size)}
    for axis in AXES:
        group = getattr(mesh, f"{axis}_group")
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=group)  # the group really connects these ranks
        info[axis] = {"ranks": dist.get_process_group_ranks(group),
                      "my_group_rank": dist.get_rank(group), "rank_sum": x.item(),
                      "mesh_ranks": list(mesh.group_ranks(axis))}
    return info


def _build_layouts(rank, world_size):
    calls = []
    real_new_group = dist.new_group

    def counting_new_group(ranks, **kwargs):  # counts real creations, independent of the cache
        calls.append(tuple(ranks))
        return real_new_group(ranks, **kwargs)

    dist.new_group = counting_new_group
    cache = ProcessGroupCache()
    meshes = [ParallelMesh(lay["ranks"], tp=lay.get("tp", 1), pp=lay.get("pp", 1),
                           dp=lay.get("dp"), cache=cache) for lay in LAYOUTS]
    dist.new_group = real_new_group
    actor, critic = meshes[0], meshes[1]  # actor tp=2 pp=2 and critic pp=2 dp=2, same 4 ranks
    return {
        "meshes": [_inspect(m) for m in meshes],
        "new_group_calls": calls,
        "cache_len": len(cache), "num_created": cache.num_created,
        "shared_pp_dp": critic.dp_group is actor.pp_group,
        "cache_identity": cache.get(actor.group_ranks("tp")) is actor.tp_group,
        "world_reused": meshes[2].tp_group is dist.group.WORLD,
        "cache_len_after_hit": len(cache),
    }


@pytest.fixture(scope="module")
def built():
    return run_distributed(_build_layouts, WORLD, timeout_s=60)


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_coordinates_groups_and_stages(built, index):
    layout = LAYOUTS[index]
    expected = _expected(**layout)
    for rank in range(WORLD):
        got = built[rank]["meshes"][index]
        if rank not in expected:
            assert not got["member"] and "not in this mesh" in got["error"]
            assert "is not a member" in got["describe"]
            continue
        want = expected[rank]
        assert got["coordinate"] == want["coordinate"]
        assert (got["next"], got["prev"], got["first"], got["last"]) == (
            want["next"], want["prev"], want["first"], want["last"])
        for axis in AXES:
            g = got[axis]
            assert g["ranks"] == want[axis] == g["mesh_ranks"], (rank, axis)
            assert g["my_group_rank"] == want[axis].index(rank)
            assert g["rank_sum"] == sum(want[axis])
        d, p, t = want["coordinate"]
        assert f"rank {rank} at dp={d} pp={p} tp={t}" in got["describe"]


def test_meshes_share_groups_and_create_each_once(built):
    every_group = set()
    for layout in LAYOUTS:
        for info in _expected(**layout).values():
            every_group.update(tuple(info[axis]) for axis in AXES)
    world = tuple(range(WORLD))
    for rank in range(WORLD):
        b = built[rank]
        assert len(b["new_group_calls"]) == len(set(b["new_group_calls"])), "duplicate group"
        assert set(b["new_group_calls"]) == every_group - {world}  # the world group is reused
        assert b["num_created"] == len(every_group) - 1
        assert b["cache_len"] == b["cache_len_after_hit"] == len(every_group)
        assert b["shared_pp_dp"] and b["cache_identity"] and b["world_reused"]
    # every rank created the same groups in the same order (new_group is collective)
    assert all(b["new_group_calls"] == built[0]["new_group_calls"] for b in built)


def _validation_errors(rank, world_size):
    cache = ProcessGroupCache()
    cases = {
        "indivisible": dict(ranks=range(2), tp=3),
        "product": dict(ranks=range(2), tp=2, dp=3),
        "repeat": dict(ranks=[0, 0]),
        "outside": dict(ranks=[0, 7]),
        "empty": dict(ranks=[]),
        "zero": dict(ranks=range(2), tp=0),
    }
    errors = {}
    for name, case in cases.items():
        ranks = case.pop("ranks")
        try:
            ParallelMesh(ranks, cache=cache, **case)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return errors, len(cache)


def test_invalid_layouts_raise_clear_value_errors():
    errors, cache_len = run_distributed(_validation_errors, 2, timeout_s=60)[0]
    assert "do not split into pp=1 × tp=3" in errors["indivisible"]
    assert "dp=3 × pp=1 × tp=2 = 6 but 2 ranks" in errors["product"]
    assert "repeat a rank" in errors["repeat"]
    assert "[7] are outside the job's ranks 0..1" in errors["outside"]
    assert "ranks is empty" in errors["empty"]
    assert "tp must be a positive integer" in errors["zero"]
    assert cache_len == 0  # nothing was created for a rejected layout


def test_mesh_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        ParallelMesh([0], cache=ProcessGroupCache())


# Roles of one colocated pool of 4 ranks: (name, tp, pp, trains); the planner's count of
# each rank's communicators must be what the cache creates and measures.
COMM_ROLES = [("actor", 2, 2, True), ("critic", 1, 2, True), ("ref", 2, 1, False)]


def _measured_communicators(rank, world_size):
    import rlhf.parallel.mesh as mesh

    made = []
    real_new_group = mesh.dist.new_group

    def new_group(ranks, **kwargs):
        made.append(tuple(ranks))
        return real_new_group(ranks, **kwargs)

    mesh.dist.new_group = new_group
    # The CUDA measurement, faked: the n-th group made reads n MiB taken.
    taken = iter(range(1, 100))
    mesh.device_bytes_taken = lambda run, device_type: (run(), next(taken) * 2**20)
    cache = ProcessGroupCache(device=torch.device("cpu"), world_bytes=5 * 2**20)
    for _, tp, pp, _ in COMM_ROLES:
        ParallelMesh(range(world_size), tp=tp, pp=pp, cache=cache)
    return {"communicators": dict(cache.communicators), "metrics": cache.communicator_metrics(),
            "made": made}


def test_the_cache_measures_each_communicator_the_planner_counts():
    from rlhf.config.schema import OffloadConfig, ParallelConfig
    from rlhf.models.config import ModelArgs
    from rlhf.plan.inputs import RoleSpec
    from rlhf.plan.memory import communicators

    per_rank = run_distributed(_measured_communicators, WORLD, timeout_s=60)
    args = ModelArgs.from_hf_config(dict(
        model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    specs = [RoleSpec(name=name, head="lm", args=args, parallel=ParallelConfig(tp=tp, pp=pp),
                      world_size=WORLD, colocated=True, dtype=None, trains=trains,
                      recompute="none", tokens=16, shards=1, offload=OffloadConfig())
             for name, tp, pp, trains in COMM_ROLES]
    planned = communicators(specs, pool_size=WORLD)
    for rank, got in enumerate(per_rank):
        joined = [k for k in got["communicators"] if k != "world"]
        want = sorted(",".join(map(str, c.ranks)) for c in planned[rank] if c.name != "world")
        assert sorted(joined) == want, rank
        metrics = got["metrics"]
        assert metrics["memory/nccl_communicators"] == len(planned[rank]) == len(joined) + 1
        # the world's 5 MiB and, per group made on this rank, the fake's reading as it was made
        readings = [got["made"].index(tuple(map(int, k.split(",")))) + 1 for k in joined]
        assert metrics["memory/nccl_gb"] == (5 + sum(readings)) * 2**20 / 2**30
