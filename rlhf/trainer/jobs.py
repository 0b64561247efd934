"""A job from its checked config to its result: join or start Ray, build each role's worker
group from the config's placement, and run PPO (or export a checkpoint's policy).

Before the workers start, the model folder exists (model.tiny builds a tiny one) and the
tokenizer loads; `job_workers` names the worker class of each role the config implies.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import ray

from rlhf.algorithms import algorithm_needs
from rlhf.config import ForwardRoleConfig, JobConfig, TinyModelConfig, job_roles
from rlhf.config.roles import ACTOR, CRITIC, REF, REWARD, ROLLOUT
from rlhf.controller import ResourcePool, RoleView, WorkerGroup
from rlhf.environ import scoped_environ
from rlhf.errors import ConfigError, RLHFError
from rlhf.files import atomic_folder
from rlhf.trainer.device import use_gpu

logger = logging.getLogger(__name__)

# Processes that set no thread count (Ray's helpers, reward actors) run one OpenMP thread; a
# rank sets torch's intra-op threads to its bundle's CPUs (ColocatedWorker), see rank_cpus.
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# A GPU rank's host work: packing micro-batches, pinned copies to and from the device, vLLM's
# scheduler and detokenizer. Up to four each leave most of an 8-GPU node's cores (typically 64
# or more) to the reward processes, the data loader and Ray.
GPU_CPUS_PER_RANK = 4


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
                     runtime_env={"env_vars": worker_env(cfg)})
        except ConnectionError as e:
            raise RLHFError(f"could not join the Ray cluster at {address} (ray.address or "
                            f"RAY_ADDRESS): {e}; start it, or unset both to run a local Ray") \
                from None
        return
    # The local raylet hands its environment to every worker, the ones it prestarts included;
    # a job runtime_env would have Ray start fresh workers and leave those idle.
    with scoped_environ(worker_env(cfg)):
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=cfg.ray.include_dashboard,
                 dashboard_port=cfg.ray.dashboard_port, namespace=cfg.ray.namespace,
                 logging_level="WARNING")


def worker_env(cfg: JobConfig) -> dict[str, str]:
    """The environment every worker of the job starts with: one OpenMP thread (see above), and
    NCCL_NVLS_ENABLE=0 when `trainer.nccl_nvls` is off (the launcher edge sets it, the memory
    planner reads the same key)."""
    env = dict(_WORKER_ENV)
    if not cfg.trainer.nccl_nvls:
        env["NCCL_NVLS_ENABLE"] = "0"
    return env


def cpus_per_rank(*, node_cpus: float, ranks_on_node: int, local_cores: int | None) -> int:
    """CPUs (and so intra-op threads) each rank of a CPU job gets: its node's share, at least 1.

    `node_cpus` is Ray's CPU count of the smallest node; `local_cores` the cores this process
    may run on when the ranks share its machine (a local cluster), since Ray's logical CPUs may
    exceed them and more threads than cores only adds contention.
    """
    if ranks_on_node < 1:
        raise ValueError(f"ranks_on_node must be at least 1, got {ranks_on_node}")
    cores = node_cpus if local_cores is None else min(node_cpus, local_cores)
    return max(1, int(cores) // ranks_on_node)


def rank_cpus(cfg: JobConfig, *, gpu: bool, ranks_on_node: int) -> int:
    """CPUs each rank's Ray bundle holds and torch's intra-op threads it runs: the one owner of
    trainer.cpus_per_rank's default, the node's share of its CPUs (`cpus_per_rank`), at most
    GPU_CPUS_PER_RANK with GPUs."""
    if cfg.trainer.cpus_per_rank is not None:
        return cfg.trainer.cpus_per_rank
    share = _job_cpus_per_rank(ranks_on_node)
    return min(GPU_CPUS_PER_RANK, share) if gpu else share


def least_rank_cpus(cfg: JobConfig) -> int:
    """What `rank_cpus` gives at least, known before any cluster is seen (the start-up checks):
    trainer.cpus_per_rank, else one (a node's share is at least one)."""
    return cfg.trainer.cpus_per_rank or 1


def _job_cpus_per_rank(ranks_on_node: int) -> int:
    """cpus_per_rank for this Ray cluster: the smallest alive node, capped by this machine's
    cores when the cluster is this machine alone."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]
    if not nodes:
        return 1
    node_cpus = min(n["Resources"]["CPU"] for n in nodes)
    here = ray.get_runtime_context().get_node_id()
    local = len(nodes) == 1 and nodes[0]["NodeID"] == here
    return cpus_per_rank(node_cpus=node_cpus, ranks_on_node=ranks_on_node,
                         local_cores=len(os.sched_getaffinity(0)) if local else None)


class RoleGroups:
    """The worker groups of one job: colocated roles share one pool, each separate role gets
    its own; `views[name]` drives a role wherever it lives."""

    def __init__(self, cfg: JobConfig, roles: Mapping[str, tuple[type, dict]], *, job_name: str,
                 role_configs: Mapping[str, ForwardRoleConfig]):
        gpu = use_gpu(cfg)
        shared = {n: spec for n, spec in roles.items()
                  if role_configs[n].placement == "colocated"}
        separate = [n for n in roles if n not in shared]
        per_node = {n: min(role_configs[n].world_size, cfg.trainer.ranks_per_node)
                    for n in separate}
        # Every pool may land on one node: split that node's CPUs over all of their ranks.
        on_node = (cfg.trainer.ranks_per_node if shared else 0) + sum(per_node.values())
        cpus = rank_cpus(cfg, gpu=gpu, ranks_on_node=on_node)
        self.groups: list[WorkerGroup] = []
        self.views: dict[str, RoleView] = {}
        try:
            if shared:
                pool = ResourcePool(f"{job_name}:shared", ranks_per_node=cfg.trainer.ranks_per_node,
                                    nnodes=cfg.trainer.nnodes, use_gpu=gpu, cpus_per_rank=cpus)
                self._add(WorkerGroup(pool, shared, job_name=job_name,
                                      init_timeout_s=cfg.trainer.init_timeout_s))
            for name in separate:
                size = role_configs[name].world_size
                if size % per_node[name]:
                    raise ConfigError(f"{name}.world_size={size} does not fill whole nodes of "
                                      f"trainer.ranks_per_node={per_node[name]} ranks")
                pool = ResourcePool(f"{job_name}:{name}", ranks_per_node=per_node[name],
                                    nnodes=size // per_node[name], use_gpu=gpu,
                                    cpus_per_rank=cpus)
                self._add(WorkerGroup(pool, {name: roles[name]}, job_name=job_name,
                                      init_timeout_s=cfg.trainer.init_timeout_s))
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


def job_workers(cfg: JobConfig) -> tuple[dict[str, tuple[type, dict]], dict[str, object]]:
    """({role: (worker class, kwargs)}, {role: its config section}) for every role of
    `config.job_roles(cfg)`, in that order: what RoleGroups builds."""
    from workers.actor import ActorWorker
    from workers.critic import CriticWorker
    from workers.reference import ReferenceWorker
    from workers.reward_model import RewardModelWorker
    from workers.rollout import RolloutWorker

    classes = {ACTOR: ActorWorker, CRITIC: CriticWorker, REF: ReferenceWorker,
               REWARD: RewardModelWorker, ROLLOUT: RolloutWorker}
    sections = job_roles(cfg, algorithm_needs(cfg))
    return {name: (classes[name], {"config": cfg}) for name in sections}, sections


def ensure_model(path: str | Path, tiny: TinyModelConfig | None) -> Path:
    """`path`, built from `tiny` (model.tiny) first when it holds no config.json."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    if tiny is None:
        raise RLHFError(f"{path} holds no model (no config.json); point model.path at a Hugging "
                        "Face folder, or set model.tiny to build a tiny one there")
    from rlhf.demo.tiny_model import make_tiny_model

    print(f"building a tiny {tiny.arch} model in {path}", flush=True)
    return Path(make_tiny_model(tiny, path))


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer of a local folder (never looked up on a model hub)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise RLHFError(f"tokenizer folder {str(path)!r} does not exist; set model.tokenizer_path "
                        "or model.path to a local folder")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


FINAL_MODEL = "hf_model"


def run_train(cfg, *, progress: bool = True, cost_models=None) -> list[dict]:
    """Build the job's worker groups, train, export the policy to OUTPUT_DIR/hf_model;
    `cost_models`: the roles' measured costs for trainer.micro_batching=cost_model.

    `rlhf train` checks the job's inputs first (rlhf.preflight); callers of this function
    directly may too."""
    from rlhf.config import config_to_dict, format_config
    from rlhf.trainer.ppo import PPOTrainer
    from rlhf.trainer.run_folder import write_run_identity

    ensure_model(cfg.model.path, cfg.model.tiny)
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(format_config(cfg), encoding="utf-8")
    write_run_identity(out, config_to_dict(cfg))  # before step 1: see run_folder.py
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    roles, role_configs = job_workers(cfg)
    groups = RoleGroups(cfg, roles, job_name=cfg.trainer.experiment_name,
                        role_configs=role_configs)
    try:
        trainer = PPOTrainer(cfg, groups.views, tokenizer=tokenizer,
                             job_name=cfg.trainer.experiment_name, progress=progress,
                             cost_models=cost_models)
        records = trainer.fit()
        with atomic_folder(out / FINAL_MODEL) as tmp:
            trainer.export_policy(tmp)
    finally:
        groups.shutdown()
    return records


def checkpoint_config(folder: Path):
    """The JobConfig a checkpoint was written with."""
    from rlhf.config import config_from_dict
    from rlhf.trainer.checkpoint import CheckpointManager

    ckpt = CheckpointManager(folder.parent.parent)
    state = ckpt.load_state(ckpt.resolve(str(folder)))  # verified against its manifest first
    return config_from_dict(state["config"]), folder


def exports_without_workers(cfg, folder: Path) -> bool:
    """Whether `export_checkpoint` writes checkpoint `folder` from its own files (a full-weight
    DCP checkpoint holds the HF tensors themselves) rather than on Ray workers."""
    from rlhf.engine.checkpoint import FORMAT_VERSION, checkpoint_format

    return not cfg.actor.lora.enabled and checkpoint_format(folder / "actor") == FORMAT_VERSION


def export_checkpoint(cfg, folder: Path, out: Path, *, merge: bool = False,
                      processes: int = 1) -> Path:
    """Load the actor shards of checkpoint `folder` on the actor's layout; write an HF folder,
    or for a LoRA run a peft adapter folder of model.path (`merge`: the merged HF folder).
    A full-weight DCP checkpoint is exported from its own metadata, without workers (nor
    Ray), by `processes` processes; otherwise Ray must be initialised."""
    from rlhf.engine.checkpoint import export_hf_folder
    from workers.checkpoint import EXPORT_BUCKET_BYTES
    from workers.sft import SFTWorker

    if out.exists() and any(out.iterdir()):
        raise RLHFError(f"{out} exists and is not empty; give a new folder")
    lora = cfg.actor.lora.enabled
    if merge and not lora:
        raise RLHFError(f"{folder} holds a full-weight policy (actor.lora.r = 0): there are no "
                        "adapters to merge; export without --merge")
    if processes < 1:
        raise RLHFError(f"processes must be at least 1, got {processes}")
    if exports_without_workers(cfg, folder):
        return export_hf_folder(folder / "actor", out, config_source=cfg.model.path,
                                bucket_bytes=EXPORT_BUCKET_BYTES, processes=processes)
    if processes > 1:
        raise RLHFError(f"{folder} is exported on the actor's workers (a LoRA run, or a "
                        "checkpoint written before format 3), which --processes does not "
                        "split; export without it")
    spec = (SFTWorker, {"config": cfg, "init_path": cfg.model.path, "plan_key": "actor",
                        "train": False})
    groups = RoleGroups(cfg, {"export": spec}, job_name=f"{cfg.trainer.experiment_name}-export",
                        role_configs={"export": cfg.actor})
    try:
        view = groups.views["export"]
        view.load_checkpoint(str(folder / "actor"))
        with atomic_folder(out) as tmp:
            view.export_hf(str(tmp), cfg.model.path, adapter=lora and not merge)
        return out
    finally:
        groups.shutdown()
