"""The per-parameter table of a built model: one `ParamInfo` per local parameter.

`param_table` fills it from the TP sharding and the pipeline stage (`build_model` returns it
beside the model); the engine adds each parameter's flat range and ZeRO-1 owners. Grad sync,
the optimizer partition, the HF export and `rlhf verify-model` all read it. The table is plain
data: no tensors, no communication.

A grad is partial over TP for replicated parameters that each rank feeds only part of the
work: the norms and row-parallel biases under sequence parallelism (each rank sees T/tp
tokens), the value head under sequence parallelism, Qwen3's q/k norms always (each rank
sees its heads), an MoE router always (its grad flows through each rank's expert shards),
and a LoRA factor replicated beside a split one (`rlhf.models.lora`).

A routed expert's parameters carry an `ExpertShard`: with expert parallelism each rank holds
E / ep of a layer's experts, so their grads are summed over the expert-data-parallel group
(not dp) and full weights are gathered over the ep group as well as over TP.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from torch import nn

from rlhf.models.lora import LoraLayer
from rlhf.models.moe import SparseMoeBlock
from rlhf.models.tp_sharding import SequenceGatheredLinear, TPState
from rlhf.models.transformer import Attention, RMSNorm
from rlhf.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class ShardLayout:
    """A parameter split over TP along `dim`; `full_size` is that dim's real (unpadded) size."""

    dim: int
    full_size: int


@dataclass(frozen=True)
class ExpertShard:
    """A parameter of routed expert `expert` (global index) of a layer whose `num_experts`
    experts are split over `ep` ranks, `num_experts / ep` consecutive ones each."""

    expert: int
    num_experts: int
    ep: int

    @property
    def ep_rank(self) -> int:
        """The rank of the ep group that holds this expert."""
        return self.expert // (self.num_experts // self.ep)


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
    trainable: bool = True
    """False for a frozen parameter (the base weights under LoRA): no grad, no optimizer state."""
    zero_owners: tuple[int, ...] = ()
    """With ZeRO-1: the DP ranks (edp ranks for an expert's) owning part of its optimizer state."""
    flat_range: tuple[int, int] | None = None
    """With a training engine: its [start, stop) in its flat grad buffer (the experts' own
    buffer for an expert parameter at ep > 1)."""
    expert: ExpertShard | None = None
    """A routed expert's parameter: which expert, and how the experts split over ep."""


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

    def with_partition(self, part, *, only: list[int] | None = None) -> ParamTable:
        """The table with each parameter's flat range and ZeRO-1 owners from `part` (an
        `rlhf.engine.zero.Partition` over the entries in order, or over the entries at the
        indices `only`, in that order; the others are left as they are)."""
        only = list(range(len(self.entries))) if only is None else only
        if len(part.numels) != len(only):
            raise ValueError(f"the partition has {len(part.numels)} parameters, the table "
                             f"{len(only)}; partition the table's parameters")
        entries = list(self.entries)
        for j, i in enumerate(only):
            entries[i] = replace(entries[i],
                                 flat_range=(part.offsets[j], part.offsets[j] + part.numels[j]),
                                 zero_owners=part.owners(j) if part.shards > 1 else ())
        return ParamTable(tuple(entries))

    def expert_indices(self, *, ep: int) -> list[int]:
        """Indices of the routed experts' parameters when experts are split over `ep` > 1
        ranks (they then sync and shard over the expert-data-parallel group); [] at ep=1."""
        return [i for i, e in enumerate(self.entries) if e.expert is not None] if ep > 1 else []


def param_table(model: nn.Module, *, tp: TPState) -> ParamTable:
    """The table of `model` as `apply_tp` (which returned `tp`) and the stage cut left it."""
    layout, partial = _tp_layout(model), _tp_partial_names(model, tp)
    experts = _expert_shards(model)
    ties = model.shared_parameters()  # {copy name: original name}
    present = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    entries = []
    for name, param in model.named_parameters():
        partner = ties.get(name) or next((c for c, o in ties.items() if o == name), None)
        shared = partner is not None and partner not in present
        entries.append(ParamInfo(
            name=name, hf_name=ties.get(name, name) if shared else name,
            shard=layout.get(name), tp_partial_grad=name in partial, shared=shared,
            tied_copy=shared and name in ties, trainable=param.requires_grad,
            expert=experts.get(name)))
    return ParamTable(tuple(entries))


def _expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """Parameter name -> its expert, for the routed experts of every MoE block: the modules
    whose `expert_placement` (`rlhf.parallel.expert_parallel.ExpertPlacement`) says how the
    experts in their `experts` dict (keyed by global index) split over ep."""
    out = {}
    for prefix, module in model.named_modules():
        placement = getattr(module, "expert_placement", None)
        if placement is None:
            continue
        dot = f"{prefix}." if prefix else ""
        for key, expert in module.experts.items():
            for n, _ in expert.named_parameters():
                out[f"{dot}experts.{key}.{n}"] = ExpertShard(int(key), placement.num_experts,
                                                             placement.ep)
    return out


def _tp_partial_names(model: nn.Module, tp: TPState) -> set[str]:
    """Names of the TP-replicated parameters whose grads are partial per TP rank."""
    if tp.tp == 1:
        return set()
    qk_norms = {id(m) for attn in model.modules() if isinstance(attn, Attention)
                for m in (attn.q_norm, attn.k_norm) if m is not None}
    names = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, RMSNorm) and (tp.sequence_parallel or id(module) in qk_norms):
            names.update(f"{dot}{n}" for n, _ in module.named_parameters())
        elif isinstance(module, SequenceGatheredLinear):
            names.update(f"{dot}{n}" for n, _ in module.named_parameters())
        elif isinstance(module, SparseMoeBlock):
            names.add(f"{dot}gate.weight")
        elif (isinstance(module, RowParallelLinear) and module.bias is not None
              and tp.sequence_parallel):
            names.add(f"{dot}bias")
        if isinstance(module, LoraLayer):
            names.update(f"{dot}{n}" for n in module.adapter_partial_grads())
    return names


def _tp_layout(model: nn.Module) -> dict[str, ShardLayout]:
    """Parameter name -> how it is split over TP; parameters not listed are replicated."""
    layout = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, ParallelLMHead):
            layout[f"{dot}weight"] = ShardLayout(0, module.vocab_size)
        elif isinstance(module, ColumnParallelLinear):
            layout[f"{dot}weight"] = ShardLayout(0, module.out_features)
            if module.bias is not None:
                layout[f"{dot}bias"] = ShardLayout(0, module.out_features)
        elif isinstance(module, RowParallelLinear):
            layout[f"{dot}weight"] = ShardLayout(1, module.in_features)
        elif isinstance(module, VocabParallelEmbedding):
            layout[f"{dot}weight"] = ShardLayout(0, module.num_embeddings)
        if isinstance(module, LoraLayer):
            layout.update({f"{dot}{n}": ShardLayout(dim, size)
                           for n, (dim, size) in module.adapter_splits().items()})
    return layout
