"""Per-token outputs of a (tensor-parallel) model on one packed micro-batch: what the engine uses.

Alignment: `log_probs[t] = log p(tokens[t+1] | tokens[..t])` inside t's sequence, the
convention of `packing.shifted_targets` and `packing.response_values(next_token=True)`; it is
0 at each sequence's last position, which predicts nothing. `entropy[t]` is the entropy of
the same next-token distribution (defined at every position). `values[t]` is the value head
at position t. Log-probs and entropy come from vocab-sharded logits: full logits are never
gathered. Every output is float32, (T,), differentiable, and the same on every TP rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from rlhf.data.packing import Packed, shifted_targets
from rlhf.data.routes import ROUTES
from rlhf.models.fused import is_fused
from rlhf.models.tp_sharding import TPState
from rlhf.models.transformer import CausalLM, ValueModel
from rlhf.models.varlen_layout import varlen_layout
from rlhf.parallel.context_parallel import ContextShard, gather_tokens, shard_tokens
from rlhf.parallel.mesh import ParallelMesh
from rlhf.parallel.tensor_parallel import ParallelLMHead
from rlhf.parallel.vocab_parallel import vocab_parallel_log_probs_entropy

LM_OUTPUTS = ("log_probs", "entropy")
VALUE_OUTPUTS = ("values",)


def sp_pad(packed: Packed, multiple: int) -> Packed:
    """`packed` with a dummy sequence appended so its token count is a multiple of `multiple`.

    Sequence parallelism splits the stream into tp equal chunks. The first T positions are
    unchanged (the dummy attends only to itself): keep `output[:T]` of anything computed.
    """
    num_tokens = packed.tokens.shape[0]
    pad = -num_tokens % multiple
    if pad == 0:
        return packed
    tokens = torch.cat([packed.tokens, packed.tokens.new_zeros((pad, *packed.tokens.shape[1:]))])
    cu = packed.cu_seqlens
    return Packed(
        tokens=tokens,
        cu_seqlens=torch.cat([cu, cu[-1:] + pad]),  # no host list copied to the GPU
        position_ids=torch.cat([packed.position_ids,
                                torch.arange(pad, device=packed.position_ids.device)]),
        max_seqlen=max(packed.max_seqlen, pad),
        prefix=None if packed.prefix is None else packed.prefix.padded(1),
    )


def forward_packed(model: nn.Module, packed: Packed, *, mesh: ParallelMesh,
                   tp: TPState = TPState()) -> Tensor:
    """Raw model output for the T tokens of `packed` (SP padding added and dropped); `tp`:
    how the model is sharded (`BuiltModel.tp`; the default: not at all).

    CausalLM: logits_TV_local (T, padded_vocab / tp), this rank's vocab shard.
    ValueModel: values_T (T,).
    """
    check_tp_matches(tp, mesh)
    num_tokens = packed.tokens.shape[0]
    if num_tokens == 0:
        raise ValueError("the packed micro-batch has no tokens; skip empty micro-batches")
    run = sp_pad(packed, tp.tp) if tp.sequence_parallel else packed
    # One host read for every layer (the engine's micro-batches carry theirs).
    layout = varlen_layout(run.cu_seqlens, run.prefix, device=run.tokens.device)
    out = model(run.tokens, run.position_ids, run.cu_seqlens, run.max_seqlen, prefix=run.prefix,
                layout=layout)
    return out[:num_tokens]


def check_tp_matches(tp: TPState, mesh: ParallelMesh) -> None:
    """ValueError unless the model was sharded for `mesh`'s TP size."""
    if mesh.tp_size != tp.tp:
        raise ValueError(f"the model was sharded for tp={tp.tp} but the mesh has "
                         f"tp={mesh.tp_size}; pass the mesh the model was built with")


def vocab_shard(model: CausalLM, mesh: ParallelMesh) -> dict:
    """Keyword arguments of `vocab_parallel_log_probs_entropy` for this model's LM head
    (`fused`: its chunks compiled, `rlhf.models.fused.apply_compile`)."""
    head = model.lm_head
    if isinstance(head, ParallelLMHead):
        return dict(group=mesh.tp_group, vocab_start=head.vocab_start, vocab_end=head.vocab_end,
                    real_vocab_size=head.vocab_size, fused=is_fused(model))
    return dict(group=None, vocab_start=0, vocab_end=head.out_features,
                real_vocab_size=head.out_features, fused=is_fused(model))


def model_outputs(model: nn.Module, packed: Packed, *, mesh: ParallelMesh,
                  tp: TPState = TPState(), outputs: Sequence[str] = LM_OUTPUTS,
                  temperature: float = 1.0) -> dict[str, Tensor]:
    """{name: (T,) float32} for `outputs` on one micro-batch (alignment in the module doc).

    CausalLM: any of "log_probs", "entropy" (of softmax(logits / temperature), the
    distribution a sampler at that temperature draws from). ValueModel: "values".
    """
    check_outputs(model, outputs, temperature)
    out = forward_packed(model, packed, mesh=mesh, tp=tp)
    return head_outputs(model, out, packed, mesh=mesh, outputs=outputs, temperature=temperature)


def check_outputs(model: nn.Module, outputs: Sequence[str], temperature: float) -> None:
    """ValueError unless `model` can give `outputs` at `temperature`."""
    allowed = VALUE_OUTPUTS if isinstance(model, ValueModel) else LM_OUTPUTS
    if model.args.is_moe:  # (T, num_layers, top_k) routes; the engine's schedules fill them
        allowed = (*allowed, ROUTES)
    unknown = [name for name in outputs if name not in allowed]
    if unknown or not outputs:
        raise ValueError(f"a {type(model).__name__} gives outputs from {allowed}; got "
                         f"{list(outputs)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def head_outputs(model: nn.Module, out: Tensor, packed: Packed, *, mesh: ParallelMesh,
                 outputs: Sequence[str], temperature: float, shard: ContextShard | None = None,
                 cp_group: ProcessGroup | None = None) -> dict[str, Tensor]:
    """`model_outputs` from the head's raw output for the T tokens of `packed` (logits_TV_local
    or values_T): also what the last pipeline stage computes.

    `shard`: `out` holds only this context-parallel rank's rows of the pack
    (`rlhf.parallel.context_parallel`); labels are shifted on the whole pack, then sharded (a
    chunk's last row predicts a token another rank holds), and every output is all-gathered
    over `cp_group` back to the whole pack. Each cp rank then computes the same loss of it, and
    the gather's backward keeps this rank's rows of that one gradient."""
    def whole(x_local: Tensor) -> Tensor:
        if shard is None:
            return x_local
        return gather_tokens(x_local, shard, group=cp_group, grad_is_partial=False)

    if isinstance(model, ValueModel):
        return {"values": whole(out.float())}
    # One fused pass gives both outputs; it divides by the temperature in float32 (bf16
    # logits / temperature would round once more, which vLLM's fp32 sampler log-probs do not),
    # and its backward skips the entropy term when the loss does not use the entropy.
    targets_T = valid_T = None
    if "log_probs" in outputs:
        targets_T, valid_T = shifted_targets(packed)
        targets_T = targets_T.to(out.device)
        if shard is not None:
            targets_T = shard_tokens(targets_T, shard)
    log_probs_T, entropy_T = vocab_parallel_log_probs_entropy(
        out, targets_T, **vocab_shard(model, mesh), temperature=temperature)
    result = {}
    if "log_probs" in outputs:
        result["log_probs"] = whole(log_probs_T).masked_fill(~valid_T.to(out.device), 0.0)
    if "entropy" in outputs:
        result["entropy"] = whole(entropy_T)
    return result
