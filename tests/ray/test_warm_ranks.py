"""Warm ranks (rlhf.controller.warm): a group shut down cleanly leaves its processes to the next
group, with nothing of its own left in them; a failed or untidy group leaves nothing."""

import os
import threading
import types

import pytest
import ray
import torch
import torch.distributed as dist

from rlhf.controller import Dispatch, ResourcePool, WorkerError, WorkerGroup, register
from rlhf.controller.warm import WARM, cold_ranks
from workers.base import Worker

pytestmark = pytest.mark.timeout(120)


class CountingRole(Worker):
    """Counts its calls: a role object left over from an earlier group would count on."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.calls = 0

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def visit(self):
        self.calls += 1
        total = torch.tensor([float(self.ctx.rank)])
        dist.all_reduce(total)  # the new world works, with this group's ranks
        return {"pid": os.getpid(), "calls": self.calls, "rank": dist.get_rank(),
                "world": dist.get_world_size(), "rank_sum": total.item(),
                "threads": torch.get_num_threads()}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def leave_a_thread(self):
        stop = threading.Event()
        threading.Thread(target=stop.wait, name="left-behind", daemon=True).start()
        self.stop = stop

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def start_process_helpers(self):
        """What vLLM's engine leaves in a rank: tqdm's monitor thread (its loaders' bars) and
        multiprocessing's resource tracker (a semaphore)."""
        import multiprocessing

        from tqdm import tqdm

        with tqdm(total=1, disable=False) as bar:
            bar.update()
        self.lock = multiprocessing.get_context("spawn").Lock()
        return {"tqdm_monitor": tqdm.monitor is not None and tqdm.monitor.is_alive(),
                "tracker": multiprocessing.resource_tracker._resource_tracker._pid}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pin_threads(self):
        """What vLLM's CPU worker does once it has started: make torch.set_num_threads a
        no-op for the rest of the process, holding it to its present thread count."""
        torch.set_num_threads = lambda n: None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def die(self):
        os._exit(3)


def group(name: str, ranks: int = 2, cpus_per_rank: int = 1) -> WorkerGroup:
    pool = ResourcePool(f"warm-{name}", ranks_per_node=ranks, use_gpu=False,
                        cpus_per_rank=cpus_per_rank)
    return WorkerGroup(pool, {"count": CountingRole}, job_name=f"warm-{name}")


def pids(wg: WorkerGroup) -> set[int]:
    return {seen["pid"] for seen in wg.visit()}


def test_a_later_group_runs_in_the_processes_of_an_earlier_one_from_scratch(ray_cluster):
    assert WARM.enabled  # tests/ray/conftest.py keeps ranks warm for the session
    with group("first") as first:
        first.visit()
        seen = first.visit()
        assert [s["calls"] for s in seen] == [2, 2]
        before = {s["pid"] for s in seen}
    with group("second", ranks=3) as second:
        seen = second.visit()
    assert before < {s["pid"] for s in seen}  # both kept processes, and one new
    assert [s["calls"] for s in seen] == [1, 1, 1]  # fresh roles
    assert [(s["rank"], s["world"], s["rank_sum"]) for s in seen] == [(r, 3, 3.0) for r in range(3)]
    assert {s["threads"] for s in seen} == {1}


def test_a_process_held_to_its_threads_serves_only_groups_of_that_many(ray_cluster):
    # Three threads: no earlier group of the session ran at that count, so these processes
    # are new or free ones, which pin_threads then holds to 3 as a vLLM CPU engine would.
    with group("pinned", cpus_per_rank=3) as first:
        first.pin_threads()
        pinned = {s["pid"]: s["threads"] for s in first.visit()}
        assert set(pinned.values()) == {3}
    with group("one-thread") as second:  # other processes: the pinned ones stay idle
        seen = second.visit()
    assert not {s["pid"] for s in seen} & set(pinned)
    assert {s["threads"] for s in seen} == {1}
    with group("three-threads", cpus_per_rank=3) as third:
        assert {s["threads"] for s in third.visit()} == {3}


@pytest.mark.parametrize("spoil", ["die", "leave_a_thread"])
def test_a_group_that_lost_a_rank_or_left_a_thread_leaves_no_process_behind(ray_cluster, spoil):
    with group(spoil) as spoilt:
        lost = pids(spoilt)
        if spoil == "die":
            with pytest.raises(WorkerError, match="process died"):
                spoilt.die()
        else:
            spoilt.leave_a_thread()
    with group(f"after-{spoil}") as after:
        assert not pids(after) & lost


def test_a_library_helper_started_by_a_role_does_not_keep_its_process_cold(ray_cluster):
    with group("helpers") as first:
        started = first.start_process_helpers()
        kept = pids(first)
    assert all(s["tqdm_monitor"] and s["tracker"] for s in started)  # both really started
    with group("after-helpers") as after:
        assert pids(after) == kept


def test_cold_ranks_are_named_processes_of_their_own(ray_cluster):
    with group("warm-one") as warm:
        kept = pids(warm)
    with cold_ranks(), group("cold") as cold:
        assert not pids(cold) & kept
        for name in cold.actor_names:
            ray.get_actor(name)  # raises if no such named actor


def test_only_cpu_groups_take_warm_ranks(ray_cluster):
    assert WARM.serves(types.SimpleNamespace(use_gpu=False))
    assert not WARM.serves(types.SimpleNamespace(use_gpu=True))
