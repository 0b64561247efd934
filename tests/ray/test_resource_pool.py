"""ResourcePool on the session cluster: bundles, rank mapping, clear errors, removal."""

import re
import time

import pytest
import ray

from rlhf.controller import ResourceError, ResourcePool

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("ray_cluster")]


def free_cpus():
    return ray.available_resources().get("CPU", 0)


def wait_for_cpus(expected, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while free_cpus() != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return free_cpus()


@pytest.fixture(autouse=True, scope="module")
def idle_cluster(ray_cluster):
    """Start from an idle session cluster: the ranks of a job that an earlier test module ran
    give their CPUs back a few seconds after the job returns, and these tests count CPUs."""
    total = ray.cluster_resources().get("CPU", 0)
    assert wait_for_cpus(total, timeout_s=30) == total, "an earlier test left ranks running"


def test_ranks_map_to_bundles_node_by_node():
    before = free_cpus()
    pool = ResourcePool("map", ranks_per_node=[2, 1], use_gpu=False)
    try:
        assert pool.world_size == 3
        first, second = pool.placement_groups
        assert [pool.bundle_of(r) for r in range(3)] == [(first, 0), (first, 1), (second, 0)]
        assert first.bundle_specs == [{"CPU": 1}, {"CPU": 1}]
        assert len(pool.node_ids()) == 3
        assert wait_for_cpus(before - 3) == before - 3
        with pytest.raises(ValueError, match="rank 3 is outside pool 'map'"):
            pool.bundle_of(3)
    finally:
        pool.remove()
    assert wait_for_cpus(before) == before
    pool.remove()  # idempotent


def test_int_ranks_per_node_repeats_over_nnodes():
    pool = ResourcePool("rep", ranks_per_node=1, nnodes=2, use_gpu=False, cpus_per_rank=2)
    try:
        assert pool.ranks_per_node == [1, 1]
        assert pool.bundle == {"CPU": 2}
    finally:
        pool.remove()


def test_more_ranks_than_the_cluster_fails_at_once():
    start = time.monotonic()
    with pytest.raises(ResourceError, match=r"needs 64 CPU \(64 ranks x 1\) but the cluster has 8"):
        ResourcePool("huge", ranks_per_node=64, use_gpu=False, timeout_s=30)
    assert time.monotonic() - start < 5


def test_gpu_pool_on_a_cpu_cluster_names_the_gpus():
    with pytest.raises(ResourceError, match="needs 2 GPU .* the cluster has 0 GPU"):
        ResourcePool("gpus", ranks_per_node=2, use_gpu=True, timeout_s=30)


def test_busy_cluster_times_out_saying_what_is_free():
    total = int(ray.cluster_resources()["CPU"])
    holder = ResourcePool("holder", ranks_per_node=total - 1, use_gpu=False)  # waits for them
    try:
        start = time.monotonic()
        with pytest.raises(ResourceError) as info:
            ResourcePool("late", ranks_per_node=2, use_gpu=False, timeout_s=1)
        assert time.monotonic() - start < 5
        message = str(info.value)
        assert "late:node0 not ready after 1 s" in message
        assert "node 0: {CPU: 2}" in message and "{CPU: 8} in total" in message
        assert re.search(r"\{CPU: [01]\} free now", message)  # the report may lag a moment
        assert wait_for_cpus(1) == 1, "the failed pool must give back what it was granted"
    finally:
        holder.remove()


@pytest.mark.parametrize("kwargs,match", [
    ({"ranks_per_node": [2, 2], "nnodes": 3}, "nnodes=3 but ranks_per_node lists 2 nodes"),
    ({"ranks_per_node": 0}, "positive ints"),
    ({"ranks_per_node": []}, "positive ints"),
    ({"ranks_per_node": 1, "cpus_per_rank": 0}, "cpus_per_rank"),
])
def test_bad_shapes_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ResourcePool("bad", use_gpu=False, **kwargs)
