"""The device of a rank, resolved once from Ray's assigned GPU ids (rlhf.controller.device),
with and without RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, and shipped in WorkerContext."""

import pytest
import torch

from rlhf.controller.device import worker_device

NODE = [str(i) for i in range(8)]  # the GPU ids Ray hands the 8 ranks of one node


def _physical(device, env):
    """The node's GPU a torch device index names in a process with environment `env`."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[device.index] if visible else str(device.index)


def test_eight_ranks_get_eight_gpus_when_ray_narrows_cuda_visible_devices():
    envs = [{"CUDA_VISIBLE_DEVICES": gpu} for gpu in NODE]  # what Ray sets by default
    devices = [worker_device([gpu], use_gpu=True, env=env) for gpu, env in zip(NODE, envs)]
    assert devices == [torch.device("cuda", 0)] * 8  # each process sees only its GPU
    assert [_physical(d, e) for d, e in zip(devices, envs)] == NODE


def test_eight_ranks_get_eight_gpus_with_noset_cuda_visible_devices():
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}  # every process sees 8 GPUs
    devices = [worker_device([gpu], use_gpu=True, env=env) for gpu in NODE]
    assert devices == [torch.device("cuda", i) for i in range(8)]
    assert len({_physical(d, env) for d in devices}) == 8


def test_noset_with_a_node_level_cuda_visible_devices_uses_the_ids_position():
    # The node was started with GPUs 4-7 visible; Ray reports the ids as listed there.
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    devices = [worker_device([gpu], use_gpu=True, env=env) for gpu in ["4", "5", "6", "7"]]
    assert devices == [torch.device("cuda", i) for i in range(4)]
    uuid = {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}
    assert worker_device(["GPU-bb"], use_gpu=True, env=uuid) == torch.device("cuda", 1)


def test_cpu_jobs_and_bad_assignments():
    assert worker_device([], use_gpu=False, env={}) == torch.device("cpu")
    with pytest.raises(ValueError, match="exactly one GPU"):
        worker_device([], use_gpu=True, env={})
    with pytest.raises(ValueError, match="exactly one GPU"):
        worker_device(["0", "1"], use_gpu=True, env={})
    with pytest.raises(ValueError, match="does not list it"):
        worker_device(["3"], use_gpu=True, env={"CUDA_VISIBLE_DEVICES": "0,1"})


def test_colocated_worker_ships_the_resolved_device_to_every_role(monkeypatch):
    """ColocatedWorker reads Ray's ids once and puts that device in each role's context (and
    makes it current); the old code put every rank on cuda:0."""
    import rlhf.controller.colocate as colocate

    class Ids:
        def get_accelerator_ids(self):
            return {"GPU": ["5"]}

    seen, current = {}, []

    class Role:
        def __init__(self, ctx):
            seen[ctx.role_name] = ctx.device

    monkeypatch.setattr(colocate.ray, "get_runtime_context", lambda: Ids())
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(colocate.torch.cuda, "set_device", current.append)
    inits = []
    monkeypatch.setattr(colocate, "init_world", lambda *a, **k: inits.append(k) or 0)
    monkeypatch.setattr(colocate.dist, "TCPStore", lambda *a, **k: object())
    worker = colocate.ColocatedWorker("job", {"actor": (Role, {}), "ref": (Role, {})},
                                      name="job/actor+ref:5", num_threads=1, use_gpu=True)
    worker.init_distributed(5, 8, "127.0.0.1", 1, "nccl", 10.0)
    monkeypatch.setattr(colocate, "ProcessGroupCache", lambda **k: None)
    worker.build_roles()
    assert seen == {"actor": torch.device("cuda", 5), "ref": torch.device("cuda", 5)}
    assert current == [torch.device("cuda", 5)]
    assert inits[0]["device"] == torch.device("cuda", 5)  # the world is bound to that GPU
