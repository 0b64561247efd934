"""One decision whether a job's ranks take GPUs (rlhf.trainer.device.use_gpu), read by the worker
pools, the local pool check and the memory planner; and trainer.init_timeout_s reaching every
worker group of a job."""

from pathlib import Path

import pytest
import ray
import torch

from rlhf.config import load_config
from rlhf.errors import ConfigError
from rlhf.plan.inputs import hardware
from rlhf.preflight import _check_local_pool
from rlhf.trainer.device import use_gpu

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


def _auto(*overrides):
    return load_config(QUICKSTART, ["trainer.device=auto", *overrides])


def test_a_driver_without_gpus_plans_for_the_joined_clusters_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the driver has none
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 16.0})
    cfg = _auto("trainer.device_memory_gb=79")
    assert use_gpu(cfg)
    assert hardware(cfg).device_type == "cuda"
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    assert hardware(cfg).device_type == "cpu"


def test_before_joining_the_local_machine_decides_and_a_named_cluster_must_be_explicit(
        monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    for present in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda present=present: present)
        assert use_gpu(_auto()) is present
    with pytest.raises(ConfigError, match="set trainer.device to cuda or cpu"):
        use_gpu(_auto("ray.address=head:6379", "ray.num_cpus=null"))
    assert use_gpu(load_config(QUICKSTART, ["trainer.device=cuda"]))
    assert not use_gpu(load_config(QUICKSTART, ["trainer.device=cpu"]))


def test_the_local_pool_check_counts_gpus_when_auto_means_gpus(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    problems = _check_local_pool(_auto("trainer.ranks_per_node=2"), "train")
    assert len(problems) == 1 and "has 1 GPUs" in problems[0]


def test_init_timeout_reaches_every_worker_group_of_the_job(monkeypatch):
    import rlhf.trainer.jobs as session

    built = []

    class Pool:
        def __init__(self, name, **kwargs):
            self.name = name

    class Group:
        def __init__(self, pool, roles, *, job_name, **kwargs):
            built.append((pool.name, sorted(roles), kwargs))

        def role_views(self):
            return {}

    monkeypatch.setattr(session, "ResourcePool", Pool)
    monkeypatch.setattr(session, "WorkerGroup", Group)
    monkeypatch.setattr(session, "_job_cpus_per_rank", lambda ranks: 1)
    cfg = load_config(QUICKSTART, ["trainer.init_timeout_s=1234", "rollout.placement=separate",
                                   "rollout.world_size=2"])
    roles = {"actor": (object, {}), "rollout": (object, {})}
    session.RoleGroups(cfg, roles, job_name="j",
                       role_configs={"actor": cfg.actor, "rollout": cfg.rollout})
    assert [(name, r) for name, r, _ in built] == [("j:shared", ["actor"]),
                                                   ("j:rollout", ["rollout"])]
    assert all(kwargs.get("init_timeout_s") == 1234 for _, _, kwargs in built)
