"""The tensor-parallel sharding of a Llama-family model: which module becomes which parallel layer.

`apply_tp` swaps the modules of a single-device `CausalLM` / `ValueModel` for Megatron-style
parallel ones; the model code itself does not change. Per decoder layer:

    q/k/v_proj, gate/up_proj   ColumnParallelLinear   (output features split)
    o_proj, down_proj          RowParallelLinear      (input features split)
    embed_tokens / lm_head     VocabParallelEmbedding / ParallelLMHead (vocab padded to tp)
    MoE experts' gate/up, down ColumnParallelLinear / RowParallelLinear weights; the router
                               replicated (the block does one gather and one reduction for all
                               experts: `rlhf.models.moe`)

Under sequence parallelism the residual stream between those regions is a (T/tp, H) token
chunk: the embedding reduce-scatters into it, every column layer all-gathers it to (T, H),
every row layer reduce-scatters back, and the LM head gathers it, so the forward of
`Transformer` works unchanged. A value head runs on the chunk; its (T/tp,) values are
gathered to (T,). Positions and cos/sin stay full-length: attention sees all T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from rlhf.errors import ConfigError
from rlhf.models.config import ModelArgs
from rlhf.models.moe import SparseMoeBlock
from rlhf.models.transformer import CausalLM, ValueModel
from rlhf.parallel.collectives import gather_from_sequence
from rlhf.parallel.mesh import ParallelMesh
from rlhf.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)

Model = CausalLM | ValueModel


@dataclass(frozen=True)
class TPState:
    """How `apply_tp` left a model: its TP size and whether it runs sequence parallel."""

    tp: int = 1
    sequence_parallel: bool = False


def check_tp_compatible(args: ModelArgs, tp: int) -> None:
    """Raise ConfigError (a ValueError) unless tp divides every dimension the plan splits."""
    for field, size in (("num_attention_heads", args.num_heads),
                        ("num_key_value_heads", args.num_kv_heads),
                        ("intermediate_size", args.intermediate_size),
                        ("moe_intermediate_size", args.moe_intermediate_size * args.is_moe)):
        if size % tp:
            raise ConfigError(f"tp={tp} does not divide {field}={size} of this "
                              f"{args.model_type} model; choose a tp that divides it")


def apply_tp(model: Model, mesh: ParallelMesh, *, sequence_parallel: bool) -> TPState:
    """Shard `model` in place over `mesh`'s TP axis (a no-op swap at tp=1; see module doc);
    return how it is sharded.

    Works on a model on the meta device (nothing is copied) or a materialised one (each rank
    keeps its slice). Tied embeddings are re-tied to the shared vocab shard.
    """
    tp = mesh.tp_size
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel needs tp > 1; pass sequence_parallel=False")
    check_tp_compatible(model.args, tp)
    state = TPState(tp=tp, sequence_parallel=sequence_parallel)
    if tp == 1:
        return state
    group, sp = mesh.tp_group, sequence_parallel
    body = model.model
    if body.embed_tokens is not None:
        body.embed_tokens = VocabParallelEmbedding.from_embedding(
            body.embed_tokens, group=group, sequence_parallel=sp)
    for layer in body.layers.values():
        attn = layer.self_attn
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.tp_group, layer.mlp.sequence_parallel = group, sp
            mlps = list(layer.mlp.experts.values())
        else:
            mlps = [layer.mlp]
        for parent, names in ((attn, ("q_proj", "k_proj", "v_proj")),
                              *((mlp, ("gate_proj", "up_proj")) for mlp in mlps)):
            for name in names:
                setattr(parent, name, ColumnParallelLinear.from_linear(
                    getattr(parent, name), group=group, sequence_parallel=sp))
        for parent in (attn, *mlps):
            name = "o_proj" if parent is attn else "down_proj"
            setattr(parent, name, RowParallelLinear.from_linear(
                getattr(parent, name), group=group, sequence_parallel=sp))
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
    if isinstance(model, CausalLM) and model.lm_head is not None:
        model.lm_head = ParallelLMHead.from_linear(model.lm_head, group=group,
                                                   sequence_parallel=sp)
        model.tie_weights()
    if isinstance(model, ValueModel) and model.score is not None and sp:
        model.score = SequenceGatheredLinear.from_linear(model.score, group=group)
    return state


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
