"""Layout: one role's dp × pp × cp × tp arrangement of positions 0..world_size-1, and its arithmetic.

Rank order (Megatron's): tp varies fastest, then cp, then pp, then dp. Position i holds
    tp_rank = i % tp,   cp_rank = (i // tp) % cp,   pp_rank = (i // (tp * cp)) % pp,
    dp_rank = i // (tp * cp * pp),
so a tp group is a run of tp consecutive positions (the ranks that should share the fastest
links) and a cp group (context parallelism: the ranks splitting one pack's tokens, which
exchange keys and values in every attention layer) the next fastest. At cp=1 every position
keeps the number it had before cp existed.
Expert parallelism is carved out of dp as in Megatron: ep_rank = dp_rank % ep and
edp_rank = dp_rank // ep, so an expert-parallel group is ep consecutive dp ranks with the same
(pp, cp, tp) and the expert-data-parallel group the dp / ep ranks holding the same experts.
At cp > 1 the cp ranks of those ranks ran other tokens through the same experts: routed
experts' grads are summed over edp × cp ("edp_cp"), as dense grads are over dp × cp.
This class is the one place that order is written down: the mesh, the dispatcher, the memory
planner and the rollout replica grouping all ask it. It is pure (no torch.distributed).
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp", "pp", "cp", "tp")  # outermost to fastest-varying
# "mp": pp × tp, one model replica; "dp_cp": the dp × cp ranks holding the same shard, whose
# grads are summed (cp ranks see different tokens of the same packs).
GROUP_AXES = (*AXES, "mp", "embedding", "dp_cp")
EXPERT_AXES = ("ep", "edp")  # expert-parallel and expert-data-parallel: both inside dp
EXPERT_CP_AXIS = "edp_cp"  # the edp × cp ranks holding the same experts (expert grads summed)


@dataclass(frozen=True)
class Layout:
    """A role's dp × pp × cp × tp layout over the positions 0..world_size-1 of its ranks."""

    dp: int
    pp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in (*AXES, "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive int, got {value!r}")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} does not divide dp={self.dp}; expert parallelism "
                             "is carved out of data parallelism, so pick an ep that divides dp")

    @classmethod
    def over(cls, world_size: int, *, tp: int = 1, pp: int = 1,
             dp: int | None = None, ep: int = 1, cp: int = 1) -> Layout:
        """The layout of `world_size` ranks with `tp`, `cp` and `pp`; dp is what remains unless
        given; `ep` experts groups are carved out of dp."""
        for name, size in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)):
            if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                     or size < 1):
                raise ValueError(f"{name} must be a positive integer, got {size!r}")
        model = tp * cp * pp
        axes = f"pp={pp} × cp={cp} × tp={tp}" if cp > 1 else f"pp={pp} × tp={tp}"
        if dp is None:
            if world_size % model:
                raise ValueError(f"{world_size} ranks do not split into {axes} groups; use a "
                                 f"number of ranks divisible by {model}")
            dp = world_size // model
        if dp * model != world_size:
            raise ValueError(f"dp={dp} × {axes} = {dp * model} but {world_size} ranks were "
                             "given; the product must equal the number of ranks")
        return cls(dp=dp, pp=pp, tp=tp, ep=ep, cp=cp)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    # ---- rank <-> coordinate -----------------------------------------------------------------

    def coordinate(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of position `rank` (its cp rank: `cp_rank`)."""
        self._check(rank)
        return (rank // (self.tp * self.cp * self.pp), (rank // (self.tp * self.cp)) % self.pp,
                rank % self.tp)

    def cp_rank(self, rank: int) -> int:
        """Context-parallel rank of position `rank`: which share of each pack's tokens it holds."""
        self._check(rank)
        return (rank // self.tp) % self.cp

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this layout's ranks 0..{self.world_size - 1}")

    def rank_at(self, *, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        """Position of the coordinate (dp, pp, cp, tp)."""
        for name, value, size in (("dp", dp, self.dp), ("pp", pp, self.pp), ("cp", cp, self.cp),
                                  ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside 0..{size - 1} of {self}")
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def stage_of(self, rank: int) -> int:
        """Pipeline stage (pp_rank) of position `rank`."""
        return self.coordinate(rank)[1]

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the dp ranks that hold the same experts."""
        return self.dp // self.ep

    @property
    def edp_cp(self) -> int:
        """Ranks that hold the same routed experts and sum their grads: edp × cp."""
        return self.edp * self.cp

    def expert_coordinate(self, rank: int) -> tuple[int, int]:
        """(ep_rank, edp_rank) of position `rank`: where its dp rank sits in its ep group and
        which ep group of its (pp, tp) line that is."""
        dp_rank = self.coordinate(rank)[0]
        return dp_rank % self.ep, dp_rank // self.ep

    # ---- groups ------------------------------------------------------------------------------

    def mesh_axes(self) -> tuple[str, ...]:
        """The axes whose groups a mesh of this layout creates, in creation order: cp and dp_cp
        only at cp > 1 (else the cp groups are single ranks and dp_cp is dp), ep and edp only
        at ep > 1 (else edp is dp), edp_cp only at both (else it is edp, or dp_cp). The memory
        planner counts communicators from the same."""
        axes = GROUP_AXES if self.cp > 1 else tuple(a for a in GROUP_AXES
                                                    if a not in ("cp", "dp_cp"))
        if self.ep == 1:
            return axes
        return axes + EXPERT_AXES + ((EXPERT_CP_AXIS,) if self.cp > 1 else ())

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along `axis` ("dp", "pp", "cp", "tp", "mp", "embedding", "dp_cp", "ep",
        "edp" or "edp_cp"), each in group-rank order; groups listed with the other coordinates in
        (dp, pp, cp, tp) order, outer first.

        "mp" is the pp × tp ranks holding one model replica (a rollout replica is the mp group
        of a dp × tp layout; at cp > 1 each cp rank's line is its own replica); "embedding" the
        first and last stage of each (dp, cp, tp) line (the two copies of tied embeddings; none
        at pp=1); "dp_cp" the dp × cp ranks holding the same shard (grads are summed over it);
        "ep" the ep consecutive dp ranks of a (pp, cp, tp) line that split the experts; "edp"
        the dp / ep ranks holding the same experts; "edp_cp" those and their cp ranks (routed
        experts' grads are summed over it), edp-major like dp_cp.
        """
        at = self.rank_at
        D, P, C, T = range(self.dp), range(self.pp), range(self.cp), range(self.tp)
        if axis == "dp":
            return [tuple(at(dp=d, pp=p, cp=c, tp=t) for d in D) for p in P for c in C for t in T]
        if axis == "pp":
            return [tuple(at(dp=d, pp=p, cp=c, tp=t) for p in P) for d in D for c in C for t in T]
        if axis == "cp":
            return [tuple(at(dp=d, pp=p, cp=c, tp=t) for c in C) for d in D for p in P for t in T]
        if axis == "tp":
            return [tuple(at(dp=d, pp=p, cp=c, tp=t) for t in T) for d in D for p in P for c in C]
        if axis == "mp":
            return [tuple(at(dp=d, pp=p, cp=c, tp=t) for p in P for t in T)
                    for d in D for c in C]
        if axis == "dp_cp":
            return [tuple(at(dp=d, pp=p, cp=c, tp=t) for d in D for c in C)
                    for p in P for t in T]
        if axis == "embedding":
            if self.pp == 1:
                return []
            return [(at(dp=d, pp=0, cp=c, tp=t), at(dp=d, pp=self.pp - 1, cp=c, tp=t))
                    for d in D for c in C for t in T]
        E, G = range(self.ep), range(self.edp)
        if axis == "ep":
            return [tuple(at(dp=g * self.ep + e, pp=p, cp=c, tp=t) for e in E)
                    for g in G for p in P for c in C for t in T]
        if axis == "edp":
            return [tuple(at(dp=g * self.ep + e, pp=p, cp=c, tp=t) for g in G)
                    for e in E for p in P for c in C for t in T]
        if axis == EXPERT_CP_AXIS:
            return [tuple(at(dp=g * self.ep + e, pp=p, cp=c, tp=t) for g in G for c in C)
                    for e in E for p in P for t in T]
        raise ValueError(f"unknown axis {axis!r}; use one of "
                         f"{(*GROUP_AXES, *EXPERT_AXES, EXPERT_CP_AXIS)}")

    def output_ranks(self) -> list[int]:
        """Per DP group, in DP order, the rank whose result is collected: tp 0 and cp 0 of the
        last stage."""
        return [self.rank_at(dp=d, pp=self.pp - 1, tp=0) for d in range(self.dp)]

