"""The tensor-parallel plan of a Llama-family model, and building one rank's shard of it.

`apply_tp` swaps the modules of a single-device `CausalLM` / `ValueModel` for Megatron-style
parallel ones; the model code itself does not change. Per decoder layer:

    q/k/v_proj, gate/up_proj   ColumnParallelLinear   (output features split)
    o_proj, down_proj          RowParallelLinear      (input features split)
    embed_tokens / lm_head     VocabParallelEmbedding / ParallelLMHead (vocab padded to tp)

Under sequence parallelism the residual stream between those regions is a (T/tp, H) token
chunk: the embedding reduce-scatters into it, every column layer all-gathers it to (T, H),
every row layer reduce-scatters back, and the LM head gathers it, so the forward of
`Transformer` works unchanged. A value head runs on the chunk; its (T/tp,) values are
gathered to (T,). Positions and cos/sin stay full-length: attention sees all T tokens.

`build_model` returns the model beside its `ParamTable`: one entry per local parameter (HF
name, TP split, whether its grad is partial over TP, pipeline ties). The engine's grad sync,
its optimizer partition, the HF export and `rlhf verify-model` all read that table. A grad is
partial over TP for replicated parameters that each rank feeds only part of the work: the
norms and row-parallel biases under sequence parallelism (each rank sees T/tp tokens), the
value head under sequence parallelism, and Qwen3's q/k norms always (each rank sees its heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from rlhf.config.schema import ParallelConfig
from rlhf.errors import ConfigError, RLHFError
from rlhf.models.config import ModelArgs
from rlhf.models.export import ExportItem, ExportStream, export_buckets
from rlhf.models.hf_io import SliceSpec, load_hf_weights
from rlhf.models.param_table import ParamInfo, ParamTable, ShardLayout
from rlhf.models.transformer import (Attention, CausalLM, RMSNorm, ValueModel,
                                     rope_inv_freq)
from rlhf.parallel.collectives import gather_from_sequence
from rlhf.parallel.mesh import ParallelMesh
from rlhf.parallel.stages import rank_chunks
from rlhf.parallel.tensor_parallel import (ColumnParallelLinear, ParallelLMHead,
                                           RowParallelLinear, VocabParallelEmbedding)

Model = CausalLM | ValueModel


class UnsupportedLayoutError(RLHFError, NotImplementedError):
    """A parallel layout that is valid but not implemented yet (pipeline parallelism)."""


@dataclass(frozen=True)
class TPState:
    """How `apply_tp` left a model; stored as `model.tp_state` (absent: tp=1, no SP)."""

    tp: int
    sequence_parallel: bool


def tp_state(model: nn.Module) -> TPState:
    """The TP size and sequence parallelism a model runs with."""
    return getattr(model, "tp_state", TPState(tp=1, sequence_parallel=False))


def check_tp_compatible(args: ModelArgs, tp: int) -> None:
    """Raise ConfigError (a ValueError) unless tp divides every dimension the plan splits."""
    for field, size in (("num_attention_heads", args.num_heads),
                        ("num_key_value_heads", args.num_kv_heads),
                        ("intermediate_size", args.intermediate_size)):
        if size % tp:
            raise ConfigError(f"tp={tp} does not divide {field}={size} of this "
                              f"{args.model_type} model; choose a tp that divides it")


def apply_tp(model: Model, mesh: ParallelMesh, *, sequence_parallel: bool) -> None:
    """Shard `model` in place over `mesh`'s TP axis (a no-op swap at tp=1; see module doc).

    Works on a model on the meta device (nothing is copied) or a materialised one (each rank
    keeps its slice). Tied embeddings are re-tied to the shared vocab shard.
    """
    tp = mesh.tp_size
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel needs tp > 1; pass sequence_parallel=False")
    check_tp_compatible(model.args, tp)
    model.tp_state = TPState(tp=tp, sequence_parallel=sequence_parallel)
    if tp == 1:
        return
    group, sp = mesh.tp_group, sequence_parallel
    body = model.model
    if body.embed_tokens is not None:
        body.embed_tokens = VocabParallelEmbedding.from_embedding(
            body.embed_tokens, group=group, sequence_parallel=sp)
    for layer in body.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        for parent, names in ((attn, ("q_proj", "k_proj", "v_proj")),
                              (mlp, ("gate_proj", "up_proj"))):
            for name in names:
                setattr(parent, name, ColumnParallelLinear.from_linear(
                    getattr(parent, name), group=group, sequence_parallel=sp))
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, group=group, sequence_parallel=sp)
        mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, group=group,
                                                      sequence_parallel=sp)
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
    if isinstance(model, CausalLM) and model.lm_head is not None:
        model.lm_head = ParallelLMHead.from_linear(model.lm_head, group=group,
                                                   sequence_parallel=sp)
        model.tie_weights()
    if isinstance(model, ValueModel) and model.score is not None and sp:
        model.score = SequenceGatheredLinear.from_linear(model.score, group=group)


class SequenceGatheredLinear(nn.Linear):
    """A TP-replicated linear (the value head) applied to this rank's token chunk under SP;
    its output is all-gathered to the full stream. Same parameter names as nn.Linear."""

    group: ProcessGroup

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: ProcessGroup) -> SequenceGatheredLinear:
        """Wrap `linear`'s parameters (shared, not copied)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.group = group
        return layer

    def forward(self, x_TH: Tensor) -> Tensor:
        # Every rank then computes the same loss on the full stream: the grad is not partial.
        return gather_from_sequence(super().forward(x_TH), group=self.group,
                                    grad_is_partial=False)


class BuiltModel(NamedTuple):
    """What `build_model` returns: this rank's model and its parameter table."""

    model: Model
    table: ParamTable


def param_table(model: Model) -> ParamTable:
    """The table of `model` as `apply_tp` and the stage cut left it (see the module doc)."""
    layout, partial = _tp_layout(model), _tp_partial_names(model)
    ties = model.shared_parameters()  # {copy name: original name}
    present = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    entries = []
    for name, _ in model.named_parameters():
        partner = ties.get(name) or next((c for c, o in ties.items() if o == name), None)
        shared = partner is not None and partner not in present
        entries.append(ParamInfo(
            name=name, hf_name=ties.get(name, name) if shared else name,
            shard=layout.get(name), tp_partial_grad=name in partial, shared=shared,
            tied_copy=shared and name in ties))
    return ParamTable(tuple(entries))


def _tp_partial_names(model: Model) -> set[str]:
    """Names of the TP-replicated parameters whose grads are partial per TP rank."""
    state = tp_state(model)
    if state.tp == 1:
        return set()
    qk_norms = {id(m) for attn in model.modules() if isinstance(attn, Attention)
                for m in (attn.q_norm, attn.k_norm) if m is not None}
    names = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, RMSNorm) and (state.sequence_parallel or id(module) in qk_norms):
            names.update(f"{dot}{n}" for n, _ in module.named_parameters())
        elif isinstance(module, SequenceGatheredLinear):
            names.update(f"{dot}{n}" for n, _ in module.named_parameters())
        elif (isinstance(module, RowParallelLinear) and module.bias is not None
              and state.sequence_parallel):
            names.add(f"{dot}bias")
    return names


def _tp_layout(model: Model) -> dict[str, ShardLayout]:
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
    return layout


def _local_range(full_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, stop) of the real entries a rank holds of a dim padded to a multiple of tp."""
    per_rank = -(-full_size // tp_size)
    start = min(tp_rank * per_rank, full_size)
    return start, min(start + per_rank, full_size)


# ---- building one rank's model ----------------------------------------------------------------


def build_model(path: str | Path, *, mesh: ParallelMesh, plan: ParallelConfig,
                head: Literal["lm", "value"], dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", value_head_seed: int = 0) -> BuiltModel:
    """This rank's shard of the HF model in `path`, laid out by `plan` over `mesh`, beside
    its `ParamTable`.

    Built on the meta device, sharded, then materialised with local shapes only; each rank
    reads just its slices from the safetensors files. `head`: "lm" (CausalLM) or "value"
    (ValueModel; a fresh head from `value_head_seed` if the folder has none). With pp > 1 the
    model holds this pipeline rank's chunks only (`rlhf.parallel.stages`; a tied LM head on
    the last stage is its own copy, loaded from the embedding).
    """
    if (mesh.tp_size, mesh.pp_size) != (plan.tp, plan.pp):
        raise ValueError(f"the mesh has tp={mesh.tp_size} pp={mesh.pp_size} but the plan says "
                         f"tp={plan.tp} pp={plan.pp}; build the mesh from the same plan")
    model_cls = {"lm": CausalLM, "value": ValueModel}.get(head)
    if model_cls is None:
        raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
    args = ModelArgs.from_pretrained(path)
    chunks, stage = None, {}
    if plan.pp > 1:
        chunks = rank_chunks(args.num_layers, pp=plan.pp, vpp=plan.vpp, pp_rank=mesh.pp_rank,
                             layers_per_stage=plan.layers_per_stage)
        stage = dict(layer_ranges=[c.layer_range for c in chunks],
                     has_embedding=chunks[0].has_embedding, has_head=chunks[-1].has_head)
    with torch.device("meta"):
        model = model_cls(args, **stage)
    if chunks is not None:
        model.pipeline_chunks = chunks  # read by the pipeline schedules
    model.to(dtype=dtype)  # still on meta: nothing allocated
    apply_tp(model, mesh, sequence_parallel=plan.sequence_parallel)
    model.to_empty(device=device)
    # to_empty makes new Parameter objects: the tie has to be redone.
    if isinstance(model, CausalLM):
        model.tie_weights()
    model.model.rotary_emb.inv_freq = rope_inv_freq(args)
    table = param_table(model)
    load_hf_weights(model, path, shard_fn=_shard_fn(table, mesh), value_head_seed=value_head_seed)
    return BuiltModel(model, table)


def _shard_fn(table: ParamTable, mesh: ParallelMesh):
    """load_hf_weights' shard_fn for this rank: the slice of each split parameter it holds."""
    layout = {e.name: e.shard for e in table if e.shard is not None}
    tp_rank, tp_size = mesh.tp_rank, mesh.tp_size

    def shard_fn(name: str, full_shape: tuple[int, ...]) -> SliceSpec | None:
        spec = layout.get(name)
        if spec is None:
            return None
        return (spec.dim, *_local_range(full_shape[spec.dim], tp_rank, tp_size))

    return shard_fn


# ---- full tensors from the shards (the collectives and buckets live in rlhf.models.export) ----


def _export_items(model: Model, *, grads: bool) -> list[ExportItem]:
    """What this rank exports: every parameter (or its grad) but the tied copies, with its
    full HF shape and how it is split over TP (read from the parameter table)."""
    table, items = param_table(model), []
    for name, param in model.named_parameters():
        entry = table[name]
        if entry.tied_copy:
            continue  # stored once, under the name it shares (the tied embedding)
        tensor = param.grad if grads else param
        if tensor is None:
            raise ValueError(f"{name} has no grad; run backward first")
        shape, spec = list(param.shape), entry.shard
        if spec is not None:
            shape[spec.dim] = spec.full_size
        items.append(ExportItem(name=name, shape=tuple(shape), local=tensor.detach(),
                                split_dim=None if spec is None else spec.dim))
    return items


def export_full_hf_weights(model: Model, mesh: ParallelMesh, *,
                           bucket_bytes: int) -> ExportStream:
    """HF-named tensors of FULL shape in buckets of at most `bucket_bytes` (a bigger one alone).

    Collective over the model group (tp x pp): every rank must run the iterator to the end, in
    step, and every rank receives every full tensor once (each DP replica gathers on its own;
    with pp > 1 the owning stage broadcasts each bucket). Replicated tensors of this stage are
    detached views of the parameters; the rest are fresh copies. A tied LM head is left out
    (HF and vLLM take it from the embedding). The stream's `times` split the seconds spent.
    """
    return export_buckets(_export_items(model, grads=False), mesh, bucket_bytes=bucket_bytes)


def gather_full_grads(model: Model, mesh: ParallelMesh) -> dict[str, Tensor]:
    """HF name -> copy of the full gradient (collective over the model group); sync the
    grads first."""
    buckets = export_buckets(_export_items(model, grads=True), mesh, bucket_bytes=1 << 62)
    return {name: tensor.clone() for bucket in buckets for name, tensor in bucket}
