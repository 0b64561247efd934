"""Whether a job's ranks take GPUs: one decision, read by the worker pools, the cluster check and
the memory planner. Imports no Ray, so the planner runs where Ray is not installed."""

from __future__ import annotations

import torch

from rlhf.config import JobConfig
from rlhf.errors import ConfigError


def use_gpu(cfg: JobConfig) -> bool:
    """trainer.device cuda, or auto on a cluster with GPUs: the Ray cluster the driver joined,
    else this machine, where the local Ray the job starts counts its GPUs."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device == "cuda"
    ray = _joined_ray()
    if ray is not None:
        return ray.cluster_resources().get("GPU", 0) > 0
    if cfg.ray.address:
        raise ConfigError(f"trainer.device=auto runs on the GPUs of the cluster at ray.address="
                          f"{cfg.ray.address}, which this process has not joined; set "
                          "trainer.device to cuda or cpu")
    return torch.cuda.is_available()


def _joined_ray():
    """The ray module when this process has joined a cluster; None when Ray is not installed
    or not initialised (nothing is started or joined here)."""
    try:
        import ray
    except ImportError:
        return None
    return ray if ray.is_initialized() else None


def actor_dtype(cfg: JobConfig) -> torch.dtype:
    """The dtype the actor's engine computes in on the device this job takes (actor.dtype
    resolved): the post-sync gap check picks its default limit by it."""
    from rlhf.engine.engine import resolve_dtype

    return resolve_dtype(cfg.actor.dtype, torch.device("cuda" if use_gpu(cfg) else "cpu"))
