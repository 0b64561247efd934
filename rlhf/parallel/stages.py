"""Pipeline stage layout: which decoder layers each (virtual) stage holds, and where they live.

The model is cut into `pp * vpp` virtual stages of consecutive layers. Virtual stage v lives
on pipeline rank v % pp (Megatron's interleaving): rank r holds chunks r, r + pp, r + 2pp, ...
The embedding belongs to virtual stage 0 (rank 0), the final norm and head to the last one
(rank pp - 1). Pure bookkeeping on integers: no tensors, no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlhf.errors import ConfigError


@dataclass(frozen=True)
class StageChunk:
    """One virtual stage: its index, its layers [start, stop), and whether it embeds / heads."""

    virtual_stage: int
    layer_range: tuple[int, int]
    has_embedding: bool
    has_head: bool

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Keys of the chunk's layers in `Transformer.layers` (global indices)."""
        return tuple(str(i) for i in range(*self.layer_range))


def split_layers(num_layers: int, *, stages: int,
                 layers_per_stage: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """[start, stop) per virtual stage: `layers_per_stage` if given, else an even split whose
    remainder goes one layer each to the stages after the first (it also holds the embedding)."""
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if layers_per_stage is not None:
        counts = [int(n) for n in layers_per_stage]
        if len(counts) != stages or min(counts) < 1 or sum(counts) != num_layers:
            raise ConfigError(f"layers_per_stage={counts} must have pp * vpp = {stages} entries, "
                              f"each at least 1, summing to the model's {num_layers} layers")
    else:
        if num_layers < stages:
            raise ConfigError(f"pp * vpp = {stages} stages need at least {stages} decoder layers "
                              f"but the model has {num_layers}; lower pp or vpp")
        base, extra = divmod(num_layers, stages)
        counts = [base + (1 if 1 <= s <= extra else 0) for s in range(stages)]
    bounds, start = [], 0
    for n in counts:
        bounds.append((start, start + n))
        start += n
    return bounds


def rank_chunks(num_layers: int, *, pp: int, vpp: int = 1, pp_rank: int,
                layers_per_stage: Sequence[int] | None = None) -> tuple[StageChunk, ...]:
    """The chunks pipeline rank `pp_rank` holds, in local order (virtual stages r, r+pp, ...)."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank must be in [0, {pp}), got {pp_rank}")
    if vpp < 1:
        raise ValueError(f"vpp must be at least 1, got {vpp}")
    stages = pp * vpp
    bounds = split_layers(num_layers, stages=stages, layers_per_stage=layers_per_stage)
    return tuple(StageChunk(virtual_stage=v, layer_range=bounds[v], has_embedding=v == 0,
                            has_head=v == stages - 1)
                 for v in range(pp_rank, stages, pp))


def stage_rank(virtual_stage: int, pp: int) -> int:
    """The pipeline rank that holds `virtual_stage`."""
    return virtual_stage % pp
