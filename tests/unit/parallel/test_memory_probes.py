"""The memory probes' CUDA branches through a patched torch.cuda (no GPU here), and the world
group bound to the rank's GPU: `init_world` passes `device_id` on CUDA only and returns what
the world's communicator took."""

import datetime

import torch

import rlhf.parallel.mesh as mesh
from rlhf.parallel import memory_probes
from rlhf.parallel.memory_probes import device_bytes_taken, free_device_bytes, memory_now

GIB = 2**30


def test_bytes_taken_outside_the_allocator_are_the_free_drop_less_what_it_reserved(monkeypatch):
    free = iter([40 * GIB, 37 * GIB])  # before, after
    reserved = iter([2 * GIB, 4 * GIB])  # the allocator grew by 2 GiB meanwhile
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (next(free), 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: next(reserved))
    result, taken = device_bytes_taken(lambda: "made", "cuda")
    assert (result, taken) == ("made", 1 * GIB)
    ran = []
    assert device_bytes_taken(lambda: ran.append(1) or "cpu", "cpu") == ("cpu", 0)
    assert ran == [1] and free_device_bytes("cpu") == 0
    assert memory_now("cpu")["host_rss_gb"] == memory_probes.host_rss_bytes() / GIB > 0


def _init_world(monkeypatch, device):
    calls, collectives = [], []
    monkeypatch.setattr(mesh.dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(mesh, "_first_collective", lambda group, dev: collectives.append(dev))
    monkeypatch.setattr(mesh, "device_bytes_taken",
                        lambda run, device_type: (run(), 7 if device_type == "cuda" else 0))
    taken = mesh.init_world("nccl" if device.type == "cuda" else "gloo", rank=1, world_size=4,
                            timeout=datetime.timedelta(seconds=5), device=device,
                            init_method="tcp://127.0.0.1:1")
    return taken, calls, collectives


def test_init_world_binds_the_default_group_to_the_gpu_and_measures_it(monkeypatch):
    cuda = torch.device("cuda", 3)
    taken, calls, collectives = _init_world(monkeypatch, cuda)
    ((args, kwargs),) = calls
    assert args == ("nccl",) and kwargs["device_id"] == cuda  # sub-groups split from it
    assert kwargs["rank"] == 1 and kwargs["world_size"] == 4
    assert kwargs["init_method"] == "tcp://127.0.0.1:1" and "store" not in kwargs
    assert taken == 7 and collectives == [cuda]
    taken, calls, _ = _init_world(monkeypatch, torch.device("cpu"))
    assert "device_id" not in calls[0][1] and taken == 0


def test_vllm_builds_its_groups_with_the_world_unbound_then_bound_again():
    """vLLM's gloo groups over some ranks must not meet a device-bound world (torch would
    split NCCL on their non-members only); the binding comes back, even after an error."""
    import pytest

    from tests.unit.engine.reference import GlooWorld

    with GlooWorld():
        world = mesh.dist.group.WORLD
        world.bound_device_id = torch.device("cuda", 2)  # as init_world leaves it on a GPU
        try:
            with mesh.world_unbound():
                assert world.bound_device_id is None
            assert world.bound_device_id == torch.device("cuda", 2)
            with pytest.raises(RuntimeError, match="vLLM failed"):
                with mesh.world_unbound():
                    raise RuntimeError("vLLM failed")
            assert world.bound_device_id == torch.device("cuda", 2)
        finally:
            world.bound_device_id = None
        with mesh.world_unbound():  # nothing bound (the CPU): nothing changes
            assert world.bound_device_id is None
