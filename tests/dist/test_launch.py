"""run_distributed: results by rank, and failures (raise, exit, kill, hang) reported promptly."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from rlhf.parallel.launch import DistributedRunError, DistributedTimeoutError, run_distributed
from rlhf.parallel.launch import free_port as _real_free_port


def _sum_of_ranks(rank, world_size, offset):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return {"rank": rank, "world": world_size, "sum": x.item() + offset,
            "threads": torch.get_num_threads()}


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits for a peer that never comes


def _exit_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _sigkill_rank_1(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return rank


def test_results_come_back_in_rank_order():
    results = run_distributed(_sum_of_ranks, 3, 0.5, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 3.5 and r["threads"] == 1 for r in results)


def test_exception_on_rank_1_names_it_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_raise_on_rank_1, 2, timeout_s=60)
    assert time.monotonic() - start < 30  # reported at once, not after the collective timeout
    assert info.value.rank == 1
    assert "rank 1 failed" in str(info.value)
    assert "ValueError: boom from rank 1" in info.value.remote_traceback
    assert "_raise_on_rank_1" in info.value.remote_traceback  # the remote frame, not ours


@pytest.mark.parametrize("fn, words", [(_exit_on_rank_1, "exited with code 3"),
                                       (_sigkill_rank_1, "killed by signal 9")])
def test_dead_rank_is_detected_promptly(fn, words):
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(fn, 2, timeout_s=60)
    assert time.monotonic() - start < 30  # well before the 60 s timeout
    assert info.value.rank == 1 and words in str(info.value)


def test_hanging_rank_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_hang_on_rank_1, 2, timeout_s=3)
    elapsed = time.monotonic() - start
    assert 3 <= elapsed < 15
    assert "did not finish within 3 s" in str(info.value) and "1]" in str(info.value)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="nproc"):
        run_distributed(_sum_of_ranks, 0, 0.0)
    with pytest.raises(ValueError, match="timeout_s"):
        run_distributed(_sum_of_ranks, 1, 0.0, timeout_s=0)
    with pytest.raises(ValueError, match="picklable"):
        run_distributed(lambda rank, world_size: rank, 1)


def test_a_rendezvous_port_taken_before_rank_0_binds_it_is_retried_on_a_new_one(monkeypatch):
    import socket

    from rlhf.parallel import launch

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]  # the first launch's port: held by another "process"
    picked = []

    def free_port():
        picked.append(ports.pop() if ports else _real_free_port())
        return picked[-1]

    monkeypatch.setattr(launch, "free_port", free_port)
    try:
        results = run_distributed(_sum_of_ranks, 2, 0.0, timeout_s=60)
    finally:
        taken.close()
    assert [r["sum"] for r in results] == [1.0, 1.0]
    assert len(picked) == 2 and picked[0] != picked[1]  # retried once, on a new port


def test_other_failures_are_not_retried(monkeypatch):
    from rlhf.parallel import launch

    calls = []
    monkeypatch.setattr(launch, "free_port", lambda: calls.append(1) or _real_free_port())
    with pytest.raises(DistributedRunError, match="boom from rank 1"):
        run_distributed(_raise_on_rank_1, 2, timeout_s=60)
    assert len(calls) == 1
