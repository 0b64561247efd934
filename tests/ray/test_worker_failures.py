"""A rank that raises, exits or is killed reaches the driver within seconds, with its name and
traceback."""

import os
import time

import pytest
import ray
import torch
import torch.distributed as dist

from rlhf.controller import (
    Dispatch,
    ResourcePool,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    register,
)
from rlhf.controller.warm import cold_ranks
from workers.base import Worker

pytestmark = pytest.mark.timeout(60)

FAST_S = 15.0  # "within seconds": well under any collective timeout, with room for a busy machine


class FragileRole(Worker):
    """Every rank joins a world all-reduce, except `bad_rank`, which raises or exits instead."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def reduce_unless(self, bad_rank, how):
        if self.ctx.rank == bad_rank:
            if how == "exit":
                os._exit(3)
            raise RuntimeError(f"injected failure on rank {bad_rank}")
        x = torch.ones(1)
        dist.all_reduce(x)  # the healthy ranks block here, waiting for bad_rank
        return x.item()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        time.sleep(seconds)
        return self.ctx.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def world_sum(self):
        x = torch.tensor([float(self.ctx.rank)])
        dist.all_reduce(x)
        return x.item()


class BrokenInit(Worker):
    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.rank == 1:
            raise ValueError("cannot load the model on rank 1")


@pytest.fixture(scope="module", autouse=True)
def _own_processes():
    """These groups' ranks die by design: processes of their own, as every production group
    has, not the warm ones the later tests of the session reuse (rlhf.controller.warm)."""
    with cold_ranks():
        yield


@pytest.fixture
def fragile(ray_cluster, request):
    pool = ResourcePool(f"fail-{request.node.name}", ranks_per_node=3, use_gpu=False)
    wg = WorkerGroup(pool, {"toy": FragileRole}, job_name=f"fail-{request.node.name}",
                     collective_timeout_s=120, error_grace_s=1.0)
    assert wg.world_sum() == [3.0] * 3  # single-role group: methods on the group itself
    yield wg
    wg.shutdown()


def test_exception_on_one_rank_surfaces_while_others_block(fragile):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        fragile.reduce_unless(2, "raise")
    elapsed = time.monotonic() - start
    err = info.value
    assert elapsed < FAST_S
    assert not isinstance(err, WorkerDiedError)
    assert (err.role, err.rank, err.method) == ("toy", 2, "reduce_unless")
    text = str(err)
    for fragment in ("role 'toy'", "rank 2", "reduce_unless", "test_worker_failures.py",
                     "RuntimeError: injected failure on rank 2",
                     "ranks [0, 1] were still running"):
        assert fragment in text
    assert "injected failure on rank 2" in err.remote_traceback
    # the stuck ranks were killed: the group refuses further calls at once
    start = time.monotonic()
    with pytest.raises(WorkerError, match="is not running"):
        fragile.world_sum()
    assert time.monotonic() - start < 1.0


def test_process_exit_inside_a_method_is_reported_as_death(fragile):
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        fragile.reduce_unless(1, "exit")
    assert time.monotonic() - start < FAST_S
    err = info.value
    assert err.rank == 1 and err.method == "reduce_unless"
    assert "rank 1" in str(err) and "process died" in str(err)
    node = ray.get_runtime_context().get_node_id()[:8]  # every rank runs on this one node
    assert f"(node {node}) (ranks [0, 1, 2] there)" in str(err)
    with pytest.raises(WorkerError, match="is not running"):
        fragile.world_sum()


def test_killed_rank_during_a_call_stops_the_job(fragile):
    pending = fragile.nap(30, blocking=False)
    time.sleep(0.5)
    ray.kill(fragile.actors[2])
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        pending.get()
    assert time.monotonic() - start < FAST_S
    assert info.value.rank == 2
    assert "killed by `ray.kill`" in str(info.value)
    # the group was shut down: the sleeping ranks do not keep the driver waiting 30 s
    with pytest.raises(WorkerError, match="is not running"):
        fragile.nap(0)


def test_rank_killed_between_calls_is_named_on_the_next_call(fragile):
    ray.kill(fragile.actors[0])
    time.sleep(0.5)
    with pytest.raises(WorkerDiedError, match=r"rank 0 \(fail-.*/toy:0\): process died"):
        fragile.world_sum()


def test_failure_while_building_roles_names_the_rank(ray_cluster):
    pool = ResourcePool("fail-init", ranks_per_node=2, use_gpu=False)
    try:
        with pytest.raises(WorkerError) as info:
            WorkerGroup(pool, {"rm": BrokenInit}, job_name="fail-init", error_grace_s=1.0)
        err = info.value
        assert (err.role, err.rank, err.method) == ("rm", 1, "build_roles")
        assert "cannot load the model on rank 1" in str(err)
    finally:
        pool.remove()
