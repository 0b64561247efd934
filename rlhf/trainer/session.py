"""Joining or starting Ray, and building the job's worker groups from the config's placement."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import ray

from rlhf.config import ForwardRoleConfig, JobConfig
from rlhf.controller import ResourcePool, RoleView, WorkerGroup
from rlhf.errors import ConfigError, RLHFError

logger = logging.getLogger(__name__)

# Ranks run one compute thread each: more threads than cores only adds contention.
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def init_ray(cfg: JobConfig, *, env_address: str | None) -> None:
    """Join ray.address (or `env_address`, the launcher's RAY_ADDRESS), else start a local Ray.

    Does nothing when Ray is already initialised (tests, notebooks, an outer driver).
    """
    if ray.is_initialized():
        return
    address = cfg.ray.address or env_address
    if address:
        if cfg.ray.num_cpus is not None:
            logger.warning("ray.num_cpus=%s is ignored: joining the cluster at %s",
                           cfg.ray.num_cpus, address)
        try:
            ray.init(address=address, namespace=cfg.ray.namespace, logging_level="WARNING",
                     runtime_env={"env_vars": _WORKER_ENV})
        except ConnectionError as e:
            raise RLHFError(f"could not join the Ray cluster at {address} (ray.address or "
                            f"RAY_ADDRESS): {e}; start it, or unset both to run a local Ray") \
                from None
        return
    ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=cfg.ray.include_dashboard,
             dashboard_port=cfg.ray.dashboard_port, namespace=cfg.ray.namespace,
             logging_level="WARNING", runtime_env={"env_vars": _WORKER_ENV})


def use_gpu(cfg: JobConfig) -> bool:
    """Whether ranks take a GPU: trainer.device cuda, or auto on a cluster that has GPUs."""
    if cfg.trainer.device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return cfg.trainer.device == "cuda"


class RoleGroups:
    """The worker groups of one job: colocated roles share one pool, each separate role gets
    its own; `views[name]` drives a role wherever it lives."""

    def __init__(self, cfg: JobConfig, roles: Mapping[str, tuple[type, dict]], *, job_name: str,
                 role_configs: Mapping[str, ForwardRoleConfig]):
        gpu = use_gpu(cfg)
        shared = {n: spec for n, spec in roles.items()
                  if role_configs[n].placement == "colocated"}
        separate = [n for n in roles if n not in shared]
        self.groups: list[WorkerGroup] = []
        self.views: dict[str, RoleView] = {}
        try:
            if shared:
                pool = ResourcePool(f"{job_name}:shared", ranks_per_node=cfg.trainer.ranks_per_node,
                                    nnodes=cfg.trainer.nnodes, use_gpu=gpu)
                self._add(WorkerGroup(pool, shared, job_name=job_name))
            for name in separate:
                size = role_configs[name].world_size
                per_node = min(size, cfg.trainer.ranks_per_node)
                if size % per_node:
                    raise ConfigError(f"{name}.world_size={size} does not fill whole nodes of "
                                      f"trainer.ranks_per_node={per_node} ranks")
                pool = ResourcePool(f"{job_name}:{name}", ranks_per_node=per_node,
                                    nnodes=size // per_node, use_gpu=gpu)
                self._add(WorkerGroup(pool, {name: roles[name]}, job_name=job_name))
        except BaseException:
            self.shutdown()
            raise

    def _add(self, group: WorkerGroup) -> None:
        self.groups.append(group)
        self.views.update(group.role_views())

    def shutdown(self) -> None:
        """Kill every rank and free the pools."""
        for group in self.groups:
            group.shutdown()
        self.groups = []
