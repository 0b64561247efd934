"""ParallelMesh: one role's dp × pp × cp × tp layout (ep inside dp) over an explicit list of ranks.

Position i of `ranks` sits where `Layout` (rlhf.parallel.layout, the one owner of the rank
order) puts position i; the mesh maps the layout's positions and groups onto global ranks.

Several meshes live in one process (actor tp=2 pp=2 and critic pp=2 dp=2 over the same 4
ranks). They share process groups through a `ProcessGroupCache` that the worker creates once
and passes to every mesh; there is no module-level state. Building a mesh is collective over
the default group: every process of the job builds every mesh, in the same order, with the
same arguments, members or not (torch's `new_group` requires all processes to enter it).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from rlhf.parallel.layout import AXES, EXPERT_AXES, EXPERT_CP_AXIS, GROUP_AXES, Layout
from rlhf.parallel.memory_probes import GB, device_bytes_taken

WORLD = "world"  # the default group's name in `ProcessGroupCache.communicators`


def init_world(backend: str, *, rank: int, world_size: int, timeout: datetime.timedelta,
               device: torch.device, store: dist.Store | None = None,
               init_method: str | None = None) -> int:
    """Create the job's default process group; return the device bytes its NCCL communicator
    took (0 off CUDA). On CUDA the group is bound to `device` (`device_id`): NCCL builds the
    world communicator now, and every later `new_group` is split from it instead of being
    initialised on its own at its first collective."""
    kwargs = {"store": store} if store is not None else {"init_method": init_method}
    if device.type == "cuda":
        kwargs["device_id"] = device
    _, taken = device_bytes_taken(lambda: (
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                **kwargs),
        _first_collective(dist.group.WORLD, device)), device.type)
    return taken


@contextmanager
def world_unbound() -> Iterator[None]:
    """The default group not bound to its device while another library (vLLM) makes its own
    groups, restored after. Bound, torch splits the world's NCCL communicator at every
    `new_group`, on non-members too, but not for a gloo group's members: vLLM's gloo groups
    over some of the ranks would leave the ranks' splits out of step (pytorch#145376). Unbound,
    vLLM's groups are made as before this project bound the world: each at its first use."""
    world = dist.group.WORLD if dist.is_initialized() else None
    bound = None if world is None else world.bound_device_id
    if bound is None:
        yield
        return
    world.bound_device_id = None
    try:
        yield
    finally:
        world.bound_device_id = bound


def _first_collective(group: ProcessGroup | None, device: torch.device) -> None:
    """One tiny all-reduce, so that a communicator NCCL creates lazily exists (and is measured)
    now rather than in the middle of a step."""
    if device.type == "cuda":
        dist.all_reduce(torch.zeros(1, device=device), group=group)


class ProcessGroupCache:
    """Maps a tuple of global ranks to its ProcessGroup so that meshes sharing a group share one.

    Create one per process (the worker does) and pass it to every ParallelMesh. Group ranks keep
    the tuple's order (group rank i is `ranks[i]`). The whole job reuses the default group.
    """

    def __init__(self, *, timeout: datetime.timedelta | None = None, backend: str | None = None,
                 device: torch.device | None = None, world_bytes: int = 0):
        self._timeout = timeout  # None: torch's default for new groups
        self._backend = backend  # None: the default group's backend
        self._groups: dict[tuple[int, ...], ProcessGroup | None] = {}
        self.num_created = 0  # new_group calls made, for tests and logs
        # With a device, each group this process joins runs its first collective at creation
        # and the communicator's device bytes are measured (`init_world` measures the world).
        self._device = device
        self.communicators: dict[str, int] = {} if device is None else {WORLD: world_bytes}

    def get(self, ranks: Sequence[int]) -> ProcessGroup | None:
        """The group over `ranks`, created on first use; None on a process outside it.

        A miss calls `new_group`, which every process of the job must reach in the same order.
        """
        key = tuple(int(r) for r in ranks)
        if key not in self._groups:
            self._groups[key] = self._create(key)
        return self._groups[key]

    def __contains__(self, ranks: Sequence[int]) -> bool:
        return tuple(int(r) for r in ranks) in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def _create(self, key: tuple[int, ...]) -> ProcessGroup | None:
        if key == tuple(range(dist.get_world_size())):
            return dist.group.WORLD
        member = dist.get_rank() in key
        group, taken = device_bytes_taken(lambda: self._new_group(key, member),
                                          self._device.type if self._device else "cpu")
        self.num_created += 1
        if member and self._device is not None:
            self.communicators[",".join(map(str, key))] = taken
        return group if member else None

    def _new_group(self, key: tuple[int, ...], member: bool) -> ProcessGroup:
        group = dist.new_group(
            list(key), timeout=self._timeout, backend=self._backend, sort_ranks=False
        )
        if member and self._device is not None:
            _first_collective(group, self._device)
        return group

    def communicator_metrics(self) -> dict[str, float]:
        """`memory/nccl_communicators` (this process's, the world's included) and
        `memory/nccl_gb` (the device memory they took as each was created); {} when the
        cache measures nothing (no device given)."""
        if self._device is None:
            return {}
        return {"memory/nccl_communicators": len(self.communicators),
                "memory/nccl_gb": sum(self.communicators.values()) / GB}


class ParallelMesh:
    """A dp × pp × cp × tp layout over `ranks`, with this process's coordinates and groups.

    `dp` is inferred from `len(ranks) // (pp * cp * tp)` when not given; `ep` (dividing dp)
    splits the experts of MoE layers; `cp` splits each pack's tokens (context parallelism).
    On a process that is not in `ranks`, `is_member` is False and
    coordinates and groups raise ValueError.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        ep: int = 1,
        cp: int = 1,
        cache: ProcessGroupCache,
    ):
        ranks = _check_ranks(ranks)
        self.layout = Layout.over(len(ranks), tp=tp, pp=pp, dp=dp, ep=ep, cp=cp)
        self.tp_size, self.pp_size, self.dp_size = self.layout.tp, self.layout.pp, self.layout.dp
        self.ep_size, self.cp_size = self.layout.ep, self.layout.cp
        self.ranks = ranks
        self.grid = torch.tensor(
            [[[ranks[self.layout.rank_at(dp=d, pp=p, tp=t)] for t in range(self.tp_size)]
              for p in range(self.pp_size)] for d in range(self.dp_size)], dtype=torch.int64
        )  # (dp, pp, tp) global ranks of cp rank 0
        self.rank = dist.get_rank()
        self.is_member = self.rank in ranks
        self._groups: dict[str, ProcessGroup | None] = {}
        self._group_ranks: dict[str, tuple[int, ...]] = {}
        # Same order on every process: every group of every axis the layout names. cp=1
        # creates no cp group (each would be one rank) and dp_cp is the dp group, so a layout
        # without context parallelism makes exactly the groups it made before cp; ep=1 creates
        # nothing either: no expert group to talk to, and the edp group is the dp group; the
        # edp_cp group exists only at both, else it is the edp group (cp=1) or dp_cp (ep=1).
        for axis in self.layout.mesh_axes():
            for positions in self.layout.groups(axis):
                self._add(axis, tuple(ranks[i] for i in positions), cache)
        if self.ep_size == 1 and "dp" in self._groups:
            self._groups["edp"] = self._groups["dp"]
            self._group_ranks["edp"] = self._group_ranks["dp"]
        if self.cp_size == 1 and "dp" in self._groups:
            self._groups["dp_cp"] = self._groups["dp"]
            self._group_ranks["dp_cp"] = self._group_ranks["dp"]
        if EXPERT_CP_AXIS not in self._groups and "dp" in self._groups:
            alias = "edp" if self.cp_size == 1 else "dp_cp"
            self._groups[EXPERT_CP_AXIS] = self._groups[alias]
            self._group_ranks[EXPERT_CP_AXIS] = self._group_ranks[alias]

    def _add(self, axis: str, group_ranks: tuple[int, ...], cache: ProcessGroupCache) -> None:
        group = cache.get(group_ranks)
        if self.rank in group_ranks:
            self._groups[axis] = group
            self._group_ranks[axis] = group_ranks

    # ---- coordinates -------------------------------------------------------------------------

    def coordinate_of(self, global_rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank of this mesh."""
        if global_rank not in self.ranks:
            raise ValueError(f"rank {global_rank} is not in this mesh (ranks {list(self.ranks)})")
        return self.layout.coordinate(self.ranks.index(global_rank))

    def rank_at(self, *, dp: int, pp: int, tp: int, cp: int | None = None) -> int:
        """Global rank at a mesh coordinate; `cp` None: this process's cp rank (a pipeline
        neighbour or a last stage sits on the same cp rank)."""
        if cp is None:
            cp = self.cp_rank if self.is_member else 0
        return self.ranks[self.layout.rank_at(dp=dp, pp=pp, tp=tp, cp=cp)]

    @property
    def coordinate(self) -> tuple[int, int, int]:
        """This process's (dp_rank, pp_rank, tp_rank)."""
        self._require_member()
        return self.coordinate_of(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coordinate[0]

    @property
    def pp_rank(self) -> int:
        return self.coordinate[1]

    @property
    def tp_rank(self) -> int:
        return self.coordinate[2]

    @property
    def cp_rank(self) -> int:
        """This process's context-parallel rank (0 at cp=1)."""
        self._require_member()
        return self.layout.cp_rank(self.ranks.index(self.rank))

    # ---- groups ------------------------------------------------------------------------------

    @property
    def tp_group(self) -> ProcessGroup:
        return self._group("tp")

    @property
    def pp_group(self) -> ProcessGroup:
        return self._group("pp")

    @property
    def dp_group(self) -> ProcessGroup:
        return self._group("dp")

    @property
    def cp_group(self) -> ProcessGroup | None:
        """Context-parallel group: the cp ranks splitting each pack's tokens, which gather keys
        and values in every attention layer; None at cp=1 (every cp collective is a no-op)."""
        self._require_member()
        return self._groups.get("cp")

    @property
    def dp_cp_group(self) -> ProcessGroup:
        """The dp × cp ranks holding the same shard: grads are summed over it (the dp group at
        cp=1)."""
        return self._group("dp_cp")

    @property
    def ep_group(self) -> ProcessGroup | None:
        """Expert-parallel group: the ep dp ranks of this (pp, tp) line that split the experts
        and exchange tokens by all-to-all; None at ep=1."""
        self._require_member()
        return self._groups.get("ep")

    @property
    def edp_group(self) -> ProcessGroup:
        """Expert-data-parallel group: the dp / ep ranks holding the same experts (expert grads
        are summed and their ZeRO-1 state split over it); the dp group at ep=1."""
        return self._group("edp")

    @property
    def edp_cp_group(self) -> ProcessGroup:
        """The edp × cp ranks holding the same routed experts: their grads are summed and their
        ZeRO-1 state split over it (the edp group at cp=1, dp_cp at ep=1)."""
        return self._group(EXPERT_CP_AXIS)

    @property
    def ep_rank(self) -> int:
        """This process's rank in its expert-parallel group (0 at ep=1)."""
        return self.layout.expert_coordinate(self.ranks.index(self.rank))[0]

    @property
    def edp_rank(self) -> int:
        """This process's rank in its expert-data-parallel group."""
        return self.layout.expert_coordinate(self.ranks.index(self.rank))[1]

    @property
    def mp_group(self) -> ProcessGroup:
        """Model-parallel group (pp × tp): the ranks that together hold one model replica."""
        return self._group("mp")

    @property
    def embedding_group(self) -> ProcessGroup | None:
        """First and last pipeline stage of this (dp, tp) line; None off those stages or at pp=1."""
        self._require_member()
        return self._groups.get("embedding")

    def group_ranks(self, axis: str) -> tuple[int, ...]:
        """Global ranks of this process's group along `axis` ("dp", "pp", "tp", "mp", "edp",
        "dp_cp", "edp_cp", "embedding" only on the first and last stage of a pipeline, "ep" only at
        ep > 1, "cp" only at cp > 1)."""
        self._require_member()
        if axis not in self._group_ranks:
            raise ValueError(f"unknown axis {axis!r} for rank {self.rank}; use one of "
                             f"{(*GROUP_AXES, *EXPERT_AXES, EXPERT_CP_AXIS)}")
        return self._group_ranks[axis]

    def _group(self, axis: str) -> ProcessGroup:
        self._require_member()
        return self._groups[axis]

    # ---- text --------------------------------------------------------------------------------

    def describe(self) -> str:
        """One line: the layout, and this process's coordinates and groups."""
        ep = f", ep={self.ep_size}" if self.ep_size > 1 else ""
        cp = f", cp={self.cp_size}" if self.cp_size > 1 else ""
        head = (f"ParallelMesh(dp={self.dp_size}, pp={self.pp_size}{cp}, tp={self.tp_size}{ep}) "
                f"over ranks {list(self.ranks)}")
        if not self.is_member:
            return f"{head}; rank {self.rank} is not a member"
        dp, pp, tp = self.coordinate
        at_cp = f" cp={self.cp_rank}" if self.cp_size > 1 else ""
        groups = ", ".join(f"{axis} group {list(self._group_ranks[axis])}" for axis in AXES
                           if axis in self._group_ranks)
        return f"{head}; rank {self.rank} at dp={dp} pp={pp}{at_cp} tp={tp}; {groups}"

    def __repr__(self) -> str:
        return self.describe()

    def _require_member(self) -> None:
        if not self.is_member:
            raise ValueError(
                f"rank {self.rank} is not in this mesh (ranks {list(self.ranks)}); "
                "check is_member before asking for coordinates or groups"
            )


def _check_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    if not dist.is_initialized():
        raise ValueError("ParallelMesh needs torch.distributed initialised (init_process_group)")
    out = tuple(int(r) for r in ranks)
    world = dist.get_world_size()
    if not out:
        raise ValueError("ranks is empty; pass the global ranks the mesh spans")
    if len(set(out)) != len(out):
        raise ValueError(f"ranks {list(out)} repeat a rank; each rank may appear once")
    bad = [r for r in out if not 0 <= r < world]
    if bad:
        raise ValueError(f"ranks {bad} are outside the job's ranks 0..{world - 1}")
    return out

