"""The per-parameter table of a built model: one `ParamInfo` per local parameter.

`rlhf.models.parallelize.param_table` fills it from the TP plan and the pipeline stage
(`build_model` returns it beside the model); the engine adds each parameter's flat range and
ZeRO-1 owners. Grad sync, the optimizer partition, the HF export and `rlhf verify-model` all
read it. Plain data: no tensors, no communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ShardLayout:
    """A parameter split over TP along `dim`; `full_size` is that dim's real (unpadded) size."""

    dim: int
    full_size: int


@dataclass(frozen=True)
class ParamInfo:
    """One local parameter of a built model: the one description every consumer reads."""

    name: str
    """Its name in `model.named_parameters()`."""
    hf_name: str
    """Its name in the full HF model; a tied copy's is the name of the parameter it equals."""
    shard: ShardLayout | None
    """How it is split over TP; None: replicated over TP."""
    tp_partial_grad: bool
    """Replicated over TP, but each TP rank holds only part of its grad: summed over TP."""
    shared: bool
    """Either side of a tie whose two copies live on different pipeline stages."""
    tied_copy: bool
    """The second copy of a shared parameter (the last stage's LM head): its grad is summed
    with the original's, it counts once in the grad norm, and the export leaves it out."""
    zero_owners: tuple[int, ...] = ()
    """With ZeRO-1: the DP ranks that own part of its optimizer state."""
    flat_range: tuple[int, int] | None = None
    """With a training engine: its [start, stop) in the flat grad buffer."""


@dataclass(frozen=True)
class ParamTable:
    """`ParamInfo` per parameter, in `model.named_parameters()` order (a tied pair once)."""

    entries: tuple[ParamInfo, ...]

    def __iter__(self) -> Iterator[ParamInfo]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __post_init__(self):
        object.__setattr__(self, "_index", {e.name: e for e in self.entries})

    def __getitem__(self, name: str) -> ParamInfo:
        if name not in self._index:
            raise KeyError(f"{name} is not a parameter of this model")
        return self._index[name]

    def with_partition(self, part) -> ParamTable:
        """The table with each parameter's flat range and ZeRO-1 owners from `part`
        (an `rlhf.engine.zero.Partition` over the entries in order)."""
        if len(part.numels) != len(self.entries):
            raise ValueError(f"the partition has {len(part.numels)} parameters, the table "
                             f"{len(self.entries)}; partition the table's parameters")
        return ParamTable(tuple(
            replace(e, flat_range=(part.offsets[i], part.offsets[i] + part.numels[i]),
                    zero_owners=part.owners(i) if part.shards > 1 else ())
            for i, e in enumerate(self.entries)))
