"""Building one rank's shard of an HF model folder: meta build, stage cut, TP sharding, weights.

`build_model` returns a `BuiltModel`: the model beside what the build computed about it, its
`ParamTable` (one entry per local parameter: HF name, TP split, partial grads, pipeline ties),
its `TPState`, with pp > 1 its pipeline chunks, and how its attention spans cp ranks. The
engine, its schedules, the HF export and `rlhf verify-model` read these from the
`BuiltModel`, never from the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from rlhf.config.schema import CpAttention, LoraConfig, ParallelConfig
from rlhf.errors import ConfigError
from rlhf.models.config import ModelArgs
from rlhf.models.expert_sharding import apply_ep
from rlhf.models.hf_io import SliceSpec, load_hf_weights
from rlhf.models.lora import apply_lora, init_lora_
from rlhf.models.param_table import ParamTable, param_table
from rlhf.models.tp_sharding import Model, TPState, apply_tp
from rlhf.models.transformer import CausalLM, ValueModel, rope_inv_freq
from rlhf.parallel.mesh import ParallelMesh
from rlhf.parallel.stages import StageChunk, rank_chunks


@dataclass(frozen=True)
class BuiltModel:
    """This rank's model and what its build computed: the parameter table, how it is sharded
    over TP, and its pipeline chunks (None: the whole model, pp = 1)."""

    model: Model
    table: ParamTable
    tp: TPState = TPState()
    chunks: tuple[StageChunk, ...] | None = None
    cp_attention: CpAttention = "all_gather"  # parallel.cp_attention, checked against the heads

    @classmethod
    def unsharded(cls, model: Model) -> BuiltModel:
        """A whole model built without `build_model` (tp = 1, pp = 1), with its table."""
        return cls(model, param_table(model, tp=TPState()))


def build_model(path: str | Path, *, mesh: ParallelMesh, parallel: ParallelConfig,
                head: Literal["lm", "value"], dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", value_head_seed: int = 0,
                lora: LoraConfig | None = None) -> BuiltModel:
    """This rank's shard of the HF model in `path`, laid out by `plan` over `mesh`.

    Built on the meta device, sharded, then materialised with local shapes only; each rank
    reads just its slices from the safetensors files. `head`: "lm" (CausalLM) or "value"
    (ValueModel; a fresh head from `value_head_seed` if the folder has none). With pp > 1 the
    model holds this pipeline rank's chunks only (`rlhf.parallel.stages`; a tied LM head on
    the last stage is its own copy, loaded from the embedding). `lora` (when enabled): adapters
    on the targeted layers, initialised from `value_head_seed`, and the base frozen
    (`rlhf.models.lora`).
    """
    if (mesh.tp_size, mesh.pp_size, mesh.ep_size) != (parallel.tp, parallel.pp, parallel.ep):
        raise ValueError(f"the mesh has tp={mesh.tp_size} pp={mesh.pp_size} ep={mesh.ep_size} "
                         f"but the plan says tp={parallel.tp} pp={parallel.pp} ep={parallel.ep}; "
                         "build the mesh from the same plan")
    model_cls = {"lm": CausalLM, "value": ValueModel}.get(head)
    if model_cls is None:
        raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
    args = ModelArgs.from_pretrained(path)
    problem = parallel.ulysses_problem(args.num_heads, args.num_kv_heads)
    if problem is not None:
        raise ConfigError(f"parallel.cp_attention=ulysses: the model's {problem}; set "
                          "parallel.cp_attention=all_gather (any number of heads)")
    chunks, stage = None, {}
    if parallel.pp > 1:
        chunks = rank_chunks(args.num_layers, pp=parallel.pp, vpp=parallel.vpp, pp_rank=mesh.pp_rank,
                             layers_per_stage=parallel.layers_per_stage)
        stage = dict(layer_ranges=[c.layer_range for c in chunks],
                     has_embedding=chunks[0].has_embedding, has_head=chunks[-1].has_head)
    with torch.device("meta"):
        model = model_cls(args, **stage)
    model.to(dtype=dtype)  # still on meta: nothing allocated
    tp = apply_tp(model, mesh, sequence_parallel=parallel.sequence_parallel)
    if lora is not None and lora.enabled:
        apply_lora(model, lora)
    apply_ep(model, mesh)
    model.to_empty(device=device)
    # to_empty makes new Parameter objects: the tie has to be redone.
    if isinstance(model, CausalLM):
        model.tie_weights()
    model.model.rotary_emb.inv_freq = rope_inv_freq(args)
    table = param_table(model, tp=tp)
    load_hf_weights(model, path, shard_fn=_shard_fn(table, mesh), value_head_seed=value_head_seed)
    if lora is not None and lora.enabled:
        init_lora_(model, seed=value_head_seed)
    return BuiltModel(model, table, tp, chunks, parallel.cp_attention)


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


def _local_range(full_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, stop) of the real entries a rank holds of a dim padded to a multiple of tp."""
    per_rank = -(-full_size // tp_size)
    start = min(tp_rank * per_rank, full_size)
    return start, min(start + per_rank, full_size)
