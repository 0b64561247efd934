"""trainer.cpus_per_rank from the config to each rank: resolved once (rlhf.trainer.jobs.rank_cpus),
held by every placement-group bundle, and set as the rank's torch threads; no cluster needed."""

from pathlib import Path

import pytest
import torch
from ray.util.placement_group import PlacementGroup

import rlhf.controller.worker_group as worker_group
import rlhf.trainer.jobs as jobs
from rlhf.config import load_config
from rlhf.controller.colocate import ColocatedWorker
from rlhf.controller.resource_pool import rank_bundle
from rlhf.errors import ConfigError

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


def test_a_bundle_holds_the_ranks_cpus_and_one_gpu():
    assert rank_bundle(cpus_per_rank=4, use_gpu=True) == {"CPU": 4, "GPU": 1}
    assert rank_bundle(cpus_per_rank=2, use_gpu=False) == {"CPU": 2}
    with pytest.raises(ValueError, match="cpus_per_rank must be at least 1"):
        rank_bundle(cpus_per_rank=0, use_gpu=False)


def test_the_config_key_is_checked():
    with pytest.raises(ConfigError, match="cpus_per_rank must be at least 1"):
        load_config(QUICKSTART, ["trainer.cpus_per_rank=0"])


@pytest.mark.parametrize("gpu, key, share, expected", [
    (True, None, 12, jobs.GPU_CPUS_PER_RANK),  # a GPU rank's default: at most 4 ...
    (True, None, 2, 2),  # ... and never more than its node's share
    (False, None, 12, 12),  # a CPU rank: the node's share
    (True, 6, 2, 6), (False, 1, 12, 1),  # an explicit value wins on either device
])
def test_each_pool_of_a_job_gets_the_resolved_cpus(monkeypatch, gpu, key, share, expected):
    pools = []

    class Pool:
        def __init__(self, name, **kwargs):
            pools.append(kwargs)

    class Group:
        def __init__(self, pool, roles, **kwargs):
            pass

        def role_views(self):
            return {}

    monkeypatch.setattr(jobs, "ResourcePool", Pool)
    monkeypatch.setattr(jobs, "WorkerGroup", Group)
    monkeypatch.setattr(jobs, "use_gpu", lambda cfg: gpu)
    monkeypatch.setattr(jobs, "_job_cpus_per_rank", lambda ranks: share)
    cfg = load_config(QUICKSTART, [f"trainer.cpus_per_rank={'null' if key is None else key}",
                                   "rollout.placement=separate", "rollout.world_size=2"])
    jobs.RoleGroups(cfg, {"actor": (object, {}), "rollout": (object, {})}, job_name="j",
                    role_configs={"actor": cfg.actor, "rollout": cfg.rollout})
    assert [p["cpus_per_rank"] for p in pools] == [expected, expected]
    assert all(p["use_gpu"] is gpu for p in pools)


def test_each_rank_reserves_its_bundles_cpus_and_runs_as_many_threads(monkeypatch):
    started = []

    class Remote:
        def options(self, **options):
            started.append(options)
            return self

        def remote(self, *args, **kwargs):
            started[-1]["num_threads"] = kwargs["num_threads"]
            return object()

    class Pool:
        world_size, use_gpu = 2, False
        bundle = rank_bundle(cpus_per_rank=3, use_gpu=False)

        def bundle_of(self, rank):
            return PlacementGroup.empty(), rank

    monkeypatch.setattr(worker_group.ray, "remote", lambda cls: Remote())
    group = worker_group.WorkerGroup.__new__(worker_group.WorkerGroup)
    group.pool, group.job_name, group._specs, group._label = Pool(), "j", {}, "actor"
    group._actors, group._warm = [], False  # processes of its own (rlhf.controller.warm)
    group._start_actors()
    assert [(o["num_cpus"], o["num_threads"]) for o in started] == [(3, 3), (3, 3)]
    threads = torch.get_num_threads()
    try:  # the rank's body sets the threads it is given
        ColocatedWorker("j", {}, name="j/actor:0", num_threads=3, use_gpu=False)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
