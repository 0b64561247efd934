"""Worker: the small base of a role object (actor, critic, reference, reward model), and how
a role builds its engine.

A role object lives in a rank's process (see rlhf.controller.colocate) next to other roles.
The process has already joined the job's torch.distributed world when the role is built; the
role picks its own tp/pp layout with `build_mesh` (through `build_engine`, from its config
section), and the dispatcher reads it from `layout`.
"""

from __future__ import annotations

from rlhf.config import ForwardRoleConfig, JobConfig
from rlhf.controller import Dispatch, register
from rlhf.controller.colocate import WorkerContext
from rlhf.engine import TrainEngine
from rlhf.errors import ConfigError
from rlhf.parallel.layout import Layout
from rlhf.parallel.mesh import ParallelMesh


class Worker:
    """Holds the WorkerContext and this role's ParallelMesh; no role logic."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.mesh: ParallelMesh | None = None

    def build_mesh(self, *, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> ParallelMesh:
        """This role's dp × pp × cp × tp mesh over all ranks of the group (collective: every
        rank of the group calls it, in the same order relative to other roles' meshes)."""
        self.mesh = ParallelMesh(range(self.ctx.world_size), tp=tp, pp=pp, ep=ep, cp=cp,
                                 cache=self.ctx.group_cache)
        return self.mesh

    @property
    def layout(self) -> Layout:
        """How the dispatcher splits and collects this role's calls; all-DP without a mesh."""
        if self.mesh is None:
            return Layout(dp=self.ctx.world_size)
        return self.mesh.layout


def build_engine(worker: Worker, config: JobConfig, key: str, *, path: str, head: str,
                 train: bool) -> TrainEngine:
    """Check `config.<key>`'s plan against the worker group, build the role's mesh and engine."""
    role: ForwardRoleConfig = getattr(config, key)
    check_layout(worker.ctx.world_size, config, key)
    mesh = worker.build_mesh(tp=role.parallel.tp, pp=role.parallel.pp, ep=role.parallel.ep,
                             cp=role.parallel.cp)
    return TrainEngine.from_pretrained(
        path, mesh=mesh, parallel=role.parallel, head=head,
        optim=role.optim if train else None, total_steps=config.trainer.total_steps,
        dtype=role.dtype, device=worker.ctx.device,
        recompute=getattr(role, "recompute", "none"), seed=config.trainer.seed,
        lora=getattr(role, "lora", None),  # forward-only too: an export loads its adapters
        router_aux_loss_coef=getattr(role, "router_aux_loss_coef", None), compile=role.compile)


def check_layout(world_size: int, config: JobConfig, key: str) -> None:
    """ConfigError naming the keys unless `config.<key>`'s plan fits a group of `world_size`."""
    role: ForwardRoleConfig = getattr(config, key)
    want = config.role_world_size(role)
    if world_size != want:
        source = (f"{key}.world_size" if role.placement == "separate"
                  else "trainer.nnodes * trainer.ranks_per_node")
        raise ConfigError(f"{key}: the worker group has {world_size} ranks but {source} = {want}; "
                          "build the group from the same config")
    model_ranks = role.parallel.model_ranks
    if world_size % model_ranks:
        axes = ("tp", "cp", "pp") if role.parallel.cp > 1 else ("tp", "pp")
        product = " * ".join(f"{key}.parallel.{a}" for a in axes)
        raise ConfigError(f"{product} = {model_ranks} ranks per model replica do not fit the "
                          f"{world_size} ranks of the worker group; use a plan whose "
                          f"{' * '.join(axes)} divides {world_size}")


class MemoryReportMixin:
    """`memory_metrics` for a role whose methods run under `in_phase` (needs `offload`, an
    rlhf.engine.offload.Offloader)."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def memory_metrics(self) -> dict[str, float]:
        """memory/<method>/* of this rank's calls since the last ask (see rlhf.engine.offload;
        the driver takes the worst rank with `worst_memory`)."""
        return self.offload.take_memory_metrics()
