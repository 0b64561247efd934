"""Shared by every tier: no test may reach a model hub (none is reachable here anyway), and a
one-process gloo world for tests that call role code in the test process."""

import datetime

import pytest
import torch.distributed as dist

from rlhf.parallel.launch import free_port


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def single_process_world():
    """A gloo world of this one process (reused if a previous module left one); its group."""
    owner = not dist.is_initialized()
    if owner:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
    yield dist.group.WORLD
    if owner:
        dist.destroy_process_group()
