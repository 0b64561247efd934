"""What the memory planner needs to know of a job: one `RoleSpec` per role the job creates.

Every fact is read from the `JobConfig` here and nowhere else in the planner: which roles run,
their model architecture, layout, dtype, recompute, token budget, ZeRO-1, offload and LoRA
switches, the device type and the memory of one device. With actor.lora on the reference
policy is the actor's base (`ref_from_actor`): no reference role, so none is planned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.algorithms import algorithm_needs
from rlhf.config import JobConfig
from rlhf.config.roles import TRAINED_ROLES, job_roles
from rlhf.config.schema import LoraConfig, OffloadConfig, ParallelConfig
from rlhf.engine.engine import resolve_dtype
from rlhf.engine.zero import num_shards
from rlhf.errors import ConfigError
from rlhf.models.config import ModelArgs
from rlhf.parallel.layout import Layout
from rlhf.trainer.device import use_gpu

GIB = 2**30
# vLLM's CUDA-graph memory pool (captured batch sizes up to max_num_seqs), unless enforce_eager:
# the residual's estimate when rollout.sleep_residual_gb is null.
VLLM_GRAPH_POOL_BYTES = 1 * GIB


class UnknownArchitecture(ConfigError):
    """A model folder that is absent here, with no stand-in config.json to plan from."""


@dataclass(frozen=True)
class RoleSpec:
    """One role as the planner sees it."""

    name: str
    head: str  # "lm" or "value"
    args: ModelArgs
    parallel: ParallelConfig
    world_size: int
    colocated: bool
    dtype: torch.dtype
    trains: bool
    recompute: str
    tokens: int  # max_tokens_per_micro_batch: one pack, split over the cp ranks
    shards: int  # ZeRO-1: ways the masters and moments are split (rlhf.engine.zero.num_shards)
    offload: OffloadConfig  # `<role>.offload`; all off for roles without the key
    lora: LoraConfig | None = None  # `<role>.lora` when on: a frozen base, adapters train
    expert_shards: int = 1  # the same for routed experts at ep > 1: over edp × cp

    @property
    def layout(self) -> Layout:
        return Layout.over(self.world_size, tp=self.parallel.tp, pp=self.parallel.pp,
                           ep=self.parallel.ep, cp=self.parallel.cp)

    @property
    def rank_tokens(self) -> int:
        """Tokens one rank runs of a full micro-batch: its cp share (the per-sequence padding
        of the split, under 2 tokens per sequence and rank, left out)."""
        return -(-self.tokens // self.parallel.cp)

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def zero1(self) -> bool:
        return self.shards > 1


@dataclass(frozen=True)
class Hardware:
    """The devices a job runs on: their type, one device's bytes, and ranks per machine."""

    device_type: str  # "cuda" or "cpu"
    device_bytes: int  # one GPU; on the CPU one machine's RAM, shared by its ranks
    ranks_per_node: int
    source: str  # where device_bytes comes from, for the report


def hardware(cfg: JobConfig) -> Hardware:
    """Device type as the worker pools decide it (rlhf.trainer.device); bytes from
    trainer.device_memory_gb, else measured on this machine."""
    device_type = "cuda" if use_gpu(cfg) else "cpu"
    size_gb = cfg.trainer.device_memory_gb
    if size_gb is not None:
        source = "trainer.device_memory_gb"
        size = int(size_gb * GIB)
    elif device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("the job runs on GPUs but this machine (the driver) has none to "
                              "measure; set trainer.device_memory_gb to one GPU's memory in GiB "
                              "(e.g. 79 for an 80 GB H100)")
        size, source = torch.cuda.get_device_properties(0).total_memory, "detected GPU"
    else:
        size, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "detected RAM"
    return Hardware(device_type=device_type, device_bytes=size,
                    ranks_per_node=cfg.trainer.ranks_per_node, source=source)


def role_specs(cfg: JobConfig, hw: Hardware, *,
               model_dirs: tuple[Path, ...] = ()) -> list[RoleSpec]:
    """The model roles this job creates (config.job_roles; the rollout pool holds only vLLM,
    which the planner counts on its own).

    `model_dirs`: folders searched for `<name of the model folder>/config.json` when a model
    folder is absent (the shipped `configs/models/`), so a plan needs no weights.
    """
    policy = model_args(cfg.model.path, cfg=cfg, key="model.path", model_dirs=model_dirs)
    specs = []
    for name, role in job_roles(cfg, algorithm_needs(cfg)).items():
        head, args = "lm", policy
        if name == "critic":
            head = "value"
            if cfg.critic.model_path is not None:
                args = model_args(cfg.critic.model_path, cfg=None, key="critic.model_path",
                                  model_dirs=model_dirs)
        elif name == "reward":
            head = "value"
            assert cfg.reward.model_path is not None  # the reward role exists only with a model
            args = model_args(cfg.reward.model_path, cfg=None, key="reward.model_path",
                              model_dirs=model_dirs)
        elif name == "rollout":
            continue
        specs.append(_spec(cfg, hw, name, role, head, args, name in TRAINED_ROLES))
    return specs


def _spec(cfg, hw, name, role, head, args, trains) -> RoleSpec:
    world = cfg.role_world_size(role)
    layout = Layout.over(world, tp=role.parallel.tp, pp=role.parallel.pp, ep=role.parallel.ep,
                         cp=role.parallel.cp)
    # ZeRO-1 splits the dense state over dp x cp (rlhf.engine.grads.sync_group)
    data_ranks, optim = layout.dp * layout.cp, getattr(role, "optim", None)
    lora = getattr(role, "lora", None)
    return RoleSpec(
        name=name, head=head, args=args, parallel=role.parallel, world_size=world,
        colocated=role.placement == "colocated",
        dtype=resolve_dtype(role.dtype, torch.device(hw.device_type)), trains=trains,
        recompute=getattr(role, "recompute", "none"), tokens=role.max_tokens_per_micro_batch,
        shards=num_shards(data_ranks, getattr(optim, "distributed", None)) if trains else 1,
        offload=getattr(role, "offload", None) or OffloadConfig(),
        lora=lora if trains and lora is not None and lora.enabled else None,
        expert_shards=(num_shards(layout.edp_cp, getattr(optim, "distributed", None))
                       if trains else 1))


def model_args(path: str, *, cfg: JobConfig | None, key: str,
               model_dirs: tuple[Path, ...]) -> ModelArgs:
    """The architecture of the model at `path`: its config.json; else the tiny spec that will
    build it (model.path only); else `<dir>/<folder name>/config.json` of a `model_dirs` entry."""
    folder = Path(path)
    if (folder / "config.json").is_file():
        return ModelArgs.from_pretrained(folder)
    if cfg is not None and cfg.model.tiny is not None:
        # the config.json make_tiny_model would write
        from rlhf.demo.tiny_model import tiny_hf_config

        return ModelArgs.from_hf_config(tiny_hf_config(cfg.model.tiny, bos_id=0, eos_id=1,
                                                       pad_id=2).to_dict())
    for models in model_dirs:
        stand_in = Path(models) / folder.name
        if (stand_in / "config.json").is_file():
            return ModelArgs.from_pretrained(stand_in)
    searched = ", ".join(str(Path(d) / folder.name) for d in model_dirs) or "nothing else"
    raise UnknownArchitecture(f"{key}: {path} has no config.json (searched {searched}); planning needs "
                      f"the architecture: put the model's config.json in a folder named "
                      f"{folder.name!r} under configs/models/ (or a folder given with --models)")


def host_memory(cfg: JobConfig) -> tuple[int, str]:
    """(one node's RAM in bytes, where it comes from): trainer.host_memory_gb, else this
    machine's RAM (the planning machine stands for the workers' nodes)."""
    size_gb = cfg.trainer.host_memory_gb
    if size_gb is not None:
        return int(size_gb * GIB), "trainer.host_memory_gb"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "detected RAM of this machine"


def vllm_residual(cfg: JobConfig) -> tuple[int, str]:
    """(bytes vLLM keeps on each of its GPUs beyond weights and KV cache, where the figure
    comes from): rollout.sleep_residual_gb (a run's measured rollout/sleep_residual_gb fed
    back, or the default), else the CUDA-graph pool alone, an estimate that misses vLLM's
    buffers and workspaces."""
    rollout = cfg.rollout
    if rollout.sleep_residual_gb is not None:
        return int(rollout.sleep_residual_gb * GIB), (
            f"rollout.sleep_residual_gb={rollout.sleep_residual_gb:g}")
    if rollout.enforce_eager:
        return 0, "estimate (rollout.sleep_residual_gb null): no CUDA graphs (enforce_eager)"
    return VLLM_GRAPH_POOL_BYTES, "estimate (rollout.sleep_residual_gb null): CUDA-graph pool"
