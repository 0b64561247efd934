"""Four ranks colocating three roles with different layouts, driven through every dispatch mode."""

import time
from collections import Counter

import pytest
import ray
import torch
import torch.distributed as dist

from rlhf.controller import Dispatch, Layout, ResourcePool, WorkerError, WorkerGroup, register
from rlhf.controller.warm import cold_ranks
from rlhf.data.batch import Batch
from workers.base import Worker

pytestmark = pytest.mark.timeout(90)

JOB = "wg-test"
LAYOUTS = {"a": Layout(dp=2, tp=2), "b": Layout(dp=4), "c": Layout(dp=1, pp=2, tp=2)}


class MeshRole(Worker):
    """Builds its own ParallelMesh over the group's ranks and reports what it sees and receives."""

    def __init__(self, ctx, *, tp=1, pp=1):
        super().__init__(ctx)
        self.build_mesh(tp=tp, pp=pp)
        self.calls = Counter()
        self.received = []  # sample ids of every DP_COMPUTE chunk this rank got

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def coordinate(self):
        return self.mesh.coordinate

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def axis_sum(self, axis):
        """All-reduce of the global rank over this role's `axis` group."""
        self.calls["axis_sum"] += 1
        x = torch.tensor([float(self.ctx.rank)])
        dist.all_reduce(x, group=getattr(self.mesh, f"{axis}_group"))
        return x.item()

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def offset(self, base, *, scale):
        return base + scale * self.ctx.rank

    @register(dispatch=Dispatch.RANK_ZERO)
    def whoami(self):
        self.calls["whoami"] += 1
        return self.ctx.rank, self.ctx.role_name

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def call_count(self, name):
        return self.calls[name]

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def take_received(self):
        out, self.received = self.received, []
        return out

    @register(dispatch=Dispatch.DP_COMPUTE)
    def forward(self, batch, *, scale=1):
        """Per sample: its id, a derived value, and the coordinates of the rank that computed it."""
        self.received.append(batch["id"].tolist())
        dp, pp, tp = self.mesh.coordinate
        n = len(batch)
        full = lambda v: torch.full((n,), v)  # noqa: E731
        return Batch({"id": batch["id"], "y": batch["id"] * scale, "dp": full(dp), "pp": full(pp),
                      "tp": full(tp), "rank": full(self.ctx.rank)})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def chunk_size(self, batch):
        return len(batch)

    @register(dispatch=Dispatch.DP_COMPUTE_METRICS)
    def update(self, batch):
        return {"mean_id": batch["id"].float().mean().item(), "samples": float(len(batch))}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def fail_everywhere(self):
        raise ValueError(f"bad argument seen by {self.ctx.role_name} rank {self.ctx.rank}")


@pytest.fixture(scope="module", autouse=True)
def _named_actors():
    """Processes of their own, named in Ray: what these tests check (rlhf.controller.warm)."""
    with cold_ranks():
        yield


@pytest.fixture(scope="module")
def group(ray_cluster):
    pool = ResourcePool("wg-pool", ranks_per_node=4, use_gpu=False)
    roles = {"a": (MeshRole, {"tp": 2}), "b": MeshRole, "c": (MeshRole, {"tp": 2, "pp": 2})}
    wg = WorkerGroup(pool, roles, job_name=JOB)
    yield wg
    wg.shutdown()


@pytest.fixture(scope="module")
def views(group):
    return group.role_views()


def ids(n):
    return Batch({"id": torch.arange(n)})


def test_actors_are_named_by_job_roles_and_rank(group):
    assert group.actor_names == [f"{JOB}/a+b+c:{r}" for r in range(4)]
    for name in group.actor_names:
        ray.get_actor(name)  # raises if no such named actor


def test_each_role_reports_its_own_layout(group, views):
    assert group.layouts == LAYOUTS
    assert {name: view.layout for name, view in views.items()} == LAYOUTS


@pytest.mark.parametrize("role", ["a", "b", "c"])
def test_role_meshes_use_megatron_rank_order(views, role):
    layout = LAYOUTS[role]
    assert views[role].coordinate() == [layout.coordinate(r) for r in range(4)]


@pytest.mark.parametrize("role,axis,expected", [
    ("a", "tp", [1, 1, 5, 5]),   # tp groups {0,1} {2,3}
    ("a", "dp", [2, 4, 2, 4]),   # dp groups {0,2} {1,3}
    ("b", "tp", [0, 1, 2, 3]),   # tp=1: a group of one
    ("b", "dp", [6, 6, 6, 6]),   # all four ranks
    ("c", "tp", [1, 1, 5, 5]),   # tp groups {0,1} {2,3}
    ("c", "pp", [2, 4, 2, 4]),   # stages: {0,2} {1,3}
])
def test_colocated_meshes_all_reduce_over_their_own_groups(views, role, axis, expected):
    assert views[role].axis_sum(axis) == expected


def test_all_to_all_gives_each_rank_its_element(views):
    assert views["b"].offset([10, 20, 30, 40], scale=[1, 1, 1, 2]) == [10, 21, 32, 46]


def test_rank_zero_runs_only_on_rank_zero(views):
    before = views["b"].call_count("whoami")
    assert views["b"].whoami() == (0, "b")
    after = views["b"].call_count("whoami")
    assert [x - y for x, y in zip(after, before)] == [1, 0, 0, 0]


@pytest.mark.parametrize("role,n", [("a", 7), ("b", 5), ("b", 3), ("c", 3), ("a", 1)])
def test_dp_compute_restores_order_and_collects_output_ranks(views, role, n):
    layout = LAYOUTS[role]
    views[role].take_received()
    out = views[role].forward(ids(n), scale=3)
    assert torch.equal(out["id"], torch.arange(n))
    assert torch.equal(out["y"], 3 * torch.arange(n))
    sizes = [len(c) for c in ids(n).chunk(layout.dp)]
    expected_dp = torch.cat([torch.full((s,), d) for d, s in enumerate(sizes)])
    assert torch.equal(out["dp"], expected_dp)
    assert set(out["tp"].tolist()) == {0}, "only tp rank 0 is collected"
    assert set(out["pp"].tolist()) == {layout.pp - 1}, "only the last stage is collected"
    output_ranks = layout.output_ranks()
    assert torch.equal(out["rank"], torch.tensor([output_ranks[d] for d in expected_dp.tolist()]))
    # every tp/pp peer of a DP rank received exactly its DP chunk
    received = views[role].take_received()
    chunks = [c["id"].tolist() for c in ids(n).chunk(layout.dp)]
    assert received == [[chunks[layout.coordinate(r)[0]]] for r in range(4)]


def test_dp_compute_puts_each_chunk_once(views, monkeypatch):
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda v, **kw: (puts.append(v), real_put(v, **kw))[1])
    out = views["a"].forward(ids(7))
    assert [len(p) for p in puts] == [4, 3]
    assert len(out) == 7


def test_dp_compute_returns_other_values_per_dp_rank(views):
    assert views["a"].chunk_size(ids(7)) == [4, 3]
    assert views["b"].chunk_size(ids(5)) == [2, 1, 1, 1]


def test_dp_compute_metrics_are_sample_weighted(views):
    metrics = views["b"].update(ids(7))  # chunks 2,2,2,1
    assert metrics == pytest.approx({"mean_id": 3.0, "samples": (4 + 4 + 4 + 1) / 7})


def test_non_blocking_calls_collect_later(views):
    first = views["a"].forward(ids(6), blocking=False)
    second = views["c"].forward(ids(4), scale=2, blocking=False)
    assert torch.equal(second.get()["y"], 2 * torch.arange(4))
    assert torch.equal(first.get()["id"], torch.arange(6))
    assert first.get() is first.get()
    deadline = time.monotonic() + 10
    while not first.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    views["a"].take_received()
    views["c"].take_received()


def test_error_on_every_rank_keeps_the_group_usable(views):
    with pytest.raises(WorkerError) as info:
        views["c"].fail_everywhere()
    err = info.value
    assert (err.job, err.role, err.method) == (JOB, "c", "fail_everywhere")
    assert "ValueError: bad argument seen by c rank" in str(err)
    assert "failed too" in str(err) and "shut down" not in str(err)
    assert views["c"].coordinate() == [LAYOUTS["c"].coordinate(r) for r in range(4)]


def test_unknown_methods_and_ambiguous_group_calls_explain_themselves(group, views):
    with pytest.raises(AttributeError, match="no method 'generate' registered.*forward"):
        _ = views["a"].generate
    with pytest.raises(AttributeError, match="role_views"):
        _ = group.forward
    with pytest.raises(AttributeError, match="no method 'take_received_'"):
        _ = views["a"].take_received_


class RewardRole(Worker):
    """A role on its own pool: its torch.distributed world is its own two ranks."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def world(self):
        x = torch.tensor([float(self.ctx.rank)])
        dist.all_reduce(x)
        return dist.get_world_size(), x.item()

    @register(dispatch=Dispatch.DP_COMPUTE)
    def score(self, batch):
        return Batch({"score": batch["id"].float() / 10, "rank": [self.ctx.rank] * len(batch)})


def test_separate_pool_is_another_group_with_its_own_world(group, views):
    pool = ResourcePool("wg-rm-pool", ranks_per_node=2, use_gpu=False)
    with WorkerGroup(pool, {"rm": RewardRole}, job_name=JOB) as rm_wg:
        assert rm_wg.actor_names == [f"{JOB}/rm:0", f"{JOB}/rm:1"]
        assert rm_wg.layouts == {"rm": Layout(dp=2)}
        assert rm_wg.world() == [(2, 1.0), (2, 1.0)]
        scores = rm_wg.score(ids(5))
        assert torch.equal(scores["score"], torch.arange(5) / 10)
        assert scores["rank"] == [0, 0, 0, 1, 1]
        assert views["b"].axis_sum("dp") == [6, 6, 6, 6]  # the colocated world is untouched
    with pytest.raises(WorkerError, match="is not running"):
        rm_wg.world()


def test_a_second_group_with_the_same_names_is_refused(group):
    pool = ResourcePool("wg-dup-pool", ranks_per_node=1, use_gpu=False)
    try:
        with pytest.raises(ValueError, match="another worker group with this job_name"):
            WorkerGroup(pool, {"a": MeshRole, "b": MeshRole, "c": MeshRole}, job_name=JOB)
    finally:
        pool.remove()
