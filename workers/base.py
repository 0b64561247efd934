"""Worker: the small base of a role object (actor, critic, reference, reward model).

A role object lives in a rank's process (see rlhf.controller.colocate) next to other roles.
The process has already joined the job's torch.distributed world when the role is built; the
role picks its own tp/pp layout with `build_mesh`, and the dispatcher reads it from `layout`.
"""

from __future__ import annotations

from rlhf.controller import Dispatch, register
from rlhf.controller.colocate import WorkerContext
from rlhf.parallel.layout import Layout
from rlhf.parallel.mesh import ParallelMesh


class Worker:
    """Holds the WorkerContext and this role's ParallelMesh; no role logic."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.mesh: ParallelMesh | None = None

    def build_mesh(self, *, tp: int = 1, pp: int = 1) -> ParallelMesh:
        """This role's dp × pp × tp mesh over all ranks of the group (collective: every rank of
        the group calls it, in the same order relative to other roles' meshes)."""
        self.mesh = ParallelMesh(range(self.ctx.world_size), tp=tp, pp=pp,
                                 cache=self.ctx.group_cache)
        return self.mesh

    @property
    def layout(self) -> Layout:
        """How the dispatcher splits and collects this role's calls; all-DP without a mesh."""
        if self.mesh is None:
            return Layout(dp=self.ctx.world_size)
        return self.mesh.layout


class MemoryReportMixin:
    """`memory_metrics` for a role whose methods run under `in_phase` (needs `offload`, an
    rlhf.engine.offload.Offloader)."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def memory_metrics(self) -> dict[str, float]:
        """memory/<method>/* of this rank's calls since the last ask (see rlhf.engine.offload;
        the driver takes the worst rank with `worst_memory`)."""
        return self.offload.take_memory_metrics()
