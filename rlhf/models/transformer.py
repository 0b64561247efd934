"""Llama-family decoder (every family in `rlhf.families`) over packed sequences (THD layout).

Reads like a single-device model. Tensor parallelism is applied afterwards by `apply_tp`,
which swaps the nn.Linear / nn.Embedding modules for parallel ones and divides each
`Attention`'s `num_heads` / `num_kv_heads` by the TP size: the forward takes every local
size from those attributes or from the tensors, never from the config. Module names are
Hugging Face's (model.layers.N.self_attn.q_proj, ..., lm_head, score), so the checkpoint
mapping in `hf_io` is the identity. MoE layers hold a `moe.SparseMoeBlock` as their `mlp`; the
optional `routing` argument of the forwards reaches those blocks only (`rlhf.models.moe`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from rlhf.data.packing import SharedPrefix
from rlhf.models.attention import varlen_attention
from rlhf.models.config import ACTIVATIONS, ModelArgs
from rlhf.models.fused import add_rms_norm, gated, qk_rope, rms_norm
from rlhf.models.gate_up import gate_up, pair_linears
from rlhf.models.moe import Routing, SparseMoeBlock
from rlhf.models.varlen_layout import VarlenLayout


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """RoPE inverse frequencies (head_dim/2,), fp32 on CPU, computed as transformers does."""
    dim = args.head_dim
    # Explicit CPU device: stays valid when the model is built under torch.device("meta").
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (args.rope_theta ** exponents)
    s = args.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the packed positions; holds no parameters or buffers."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        # A plain attribute, not a buffer, so meta init + to_empty() cannot wipe it.
        self.inv_freq = rope_inv_freq(args)

    def forward(self, position_ids_T: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != position_ids_T.device:  # once per device, not per call: a
            self.inv_freq = self.inv_freq.to(position_ids_T.device)  # host copy syncs CUDA
        inv_freq = self.inv_freq
        freqs_TF = position_ids_T[:, None].float() * inv_freq[None, :]
        emb_TD = torch.cat((freqs_TF, freqs_TF), dim=-1)
        return emb_TD.cos().to(dtype), emb_TD.sin().to(dtype)


class RMSNorm(nn.Module):
    """RMSNorm as transformers computes it for the family: "llama" normalises in fp32, casts
    back, then scales; "gemma" scales by (1 + weight) in fp32, then casts."""

    def __init__(self, dim: int, eps: float, style: str = "llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if style == "llama" else torch.zeros(dim))
        self.eps = eps
        self.offset = style == "gemma"
        self.fused = False  # rlhf.models.fused.apply_compile

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(self.fused, x, self.weight, self.eps, self.offset)

    def add_forward(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """(x + delta, self(x + delta)): a residual add and this norm in one pass."""
        return add_rms_norm(self.fused, x, delta, self.weight, self.eps, self.offset)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, optional qkv bias and per-head q/k RMSNorm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        # Local head counts: apply_tp divides these by the TP size when it shards q/k/v/o.
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim ** -0.5
        q_out, kv_out = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_out, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_out, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_out, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_out, args.hidden_size, bias=args.o_bias)
        self.q_norm = _norm(args, args.head_dim) if args.qk_norm else None
        self.k_norm = _norm(args, args.head_dim) if args.qk_norm else None
        self.fused = False  # rlhf.models.fused.apply_compile

    def forward(self, hidden_TH: Tensor, cos_TD: Tensor, sin_TD: Tensor, cu_seqlens: Tensor,
                max_seqlen: int, prefix: SharedPrefix | None = None,
                layout: VarlenLayout | None = None) -> Tensor:
        # -1 on the token axis: with sequence parallelism q_proj's output has more tokens
        # (all-gathered) than hidden_TH.
        q_THD = self.q_proj(hidden_TH).view(-1, self.num_heads, self.head_dim)
        k_THD = self.k_proj(hidden_TH).view(-1, self.num_kv_heads, self.head_dim)
        v_THD = self.v_proj(hidden_TH).view(-1, self.num_kv_heads, self.head_dim)
        q_norm, k_norm = self.q_norm, self.k_norm
        if q_norm is not None and k_norm is not None:
            q_THD, k_THD = qk_rope(self.fused, q_THD, k_THD, cos_TD, sin_TD, q_norm.weight,
                                   k_norm.weight, q_norm.eps, q_norm.offset)
        else:
            q_THD, k_THD = qk_rope(self.fused, q_THD, k_THD, cos_TD, sin_TD, None, None, 0.0,
                                   False)
        out_THD = varlen_attention(q_THD, k_THD, v_THD, cu_seqlens=cu_seqlens,
                                   max_seqlen=max_seqlen, causal=True, scale=self.scale,
                                   prefix=prefix, layout=layout)
        return self.o_proj(out_THD.reshape(out_THD.shape[0], -1))


def _norm(args: ModelArgs, dim: int) -> RMSNorm:
    return RMSNorm(dim, args.rms_norm_eps, args.family.rms_norm)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.act = ACTIVATIONS[args.hidden_act]
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.fused = False  # rlhf.models.fused.apply_compile

    def forward(self, x_TH: Tensor) -> Tensor:
        # One GEMM for both when their weights are paired (rlhf.models.gate_up), else two.
        gate_TI, up_TI = gate_up(self.gate_proj, self.up_proj, x_TH)
        return self.down_proj(gated(self.fused, self.act, gate_TI, up_TI))


def pair_gate_up(model: nn.Module) -> int:
    """Pair each dense MLP's gate and up weights for one GEMM (`rlhf.models.gate_up`; MoE
    experts have their own grouped GEMMs); returns how many MLPs are paired."""
    return sum(pair_linears(m.gate_proj, m.up_proj) for m in model.modules()
               if isinstance(m, MLP))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP (or sparse MoE on an MoE layer)."""

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.input_layernorm = _norm(args, args.hidden_size)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = _norm(args, args.hidden_size)
        self.mlp = SparseMoeBlock(args, layer=layer) if args.is_moe_layer(layer) else MLP(args)

    def forward(self, hidden_TH: Tensor, cos_TD: Tensor, sin_TD: Tensor, cu_seqlens: Tensor,
                max_seqlen: int, prefix: SharedPrefix | None = None,
                layout: VarlenLayout | None = None, routing: Routing | None = None) -> Tensor:
        attn_TH = self.self_attn(self.input_layernorm(hidden_TH), cos_TD, sin_TD, cu_seqlens,
                                 max_seqlen, prefix, layout)
        hidden_TH, normed_TH = self.post_attention_layernorm.add_forward(hidden_TH, attn_TH)
        if isinstance(self.mlp, SparseMoeBlock):
            return hidden_TH + self.mlp(normed_TH, routing)
        return hidden_TH + self.mlp(normed_TH)


class Transformer(nn.Module):
    """The decoder body (HF's `model.` prefix), or a contiguous range of it for a pipeline stage.

    Layers live in a ModuleDict keyed by their global index, so stage parameters keep HF names.
    """

    def __init__(self, args: ModelArgs, *, layer_range: tuple[int, int] | None = None,
                 layer_ranges: Sequence[tuple[int, int]] | None = None,
                 has_embedding: bool = True, has_norm: bool = True):
        super().__init__()
        if layer_range is not None and layer_ranges is not None:
            raise ValueError("pass layer_range or layer_ranges, not both")
        ranges = (tuple(layer_ranges) if layer_ranges is not None
                  else (layer_range if layer_range is not None else (0, args.num_layers),))
        for start, stop in ranges:
            if not 0 <= start <= stop <= args.num_layers:
                raise ValueError(f"layer_range must satisfy 0 <= start <= stop <= "
                                 f"{args.num_layers}, got {(start, stop)}")
        ids = [i for start, stop in ranges for i in range(start, stop)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"layer_ranges {list(ranges)} overlap; give each layer to one range")
        # Several ranges: the virtual pipeline stages (interleaved 1F1B) one rank holds.
        self.layer_ranges = tuple(tuple(r) for r in ranges)
        self.layer_range = self.layer_ranges[0] if len(ranges) == 1 else None
        self.embed_tokens = (nn.Embedding(args.vocab_size, args.hidden_size) if has_embedding
                             else None)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, i) for i in sorted(ids)})
        self.norm = _norm(args, args.hidden_size) if has_norm else None
        self.rotary_emb = RotaryEmbedding(args)
        # Gemma's embedding multiplier sqrt(hidden), rounded to each dtype as transformers does.
        self.embed_scale = args.hidden_size ** 0.5 if args.family.embed_scale else None

    def forward(self, inputs: Tensor, position_ids_T: Tensor, cu_seqlens: Tensor,
                max_seqlen: int, *, prefix: SharedPrefix | None = None,
                layout: VarlenLayout | None = None, routing: Routing | None = None) -> Tensor:
        """tokens_T (with the embedding) or hidden_TH (a later stage) -> hidden_TH.

        The output is after the final norm when this part has it. `prefix`: the packing's
        shared prompts (rlhf.data.packing.SharedPrefix), None when nothing is shared.
        `layout`: the stream's host lengths (`varlen_layout.VarlenLayout`), built once per
        micro-batch; None: each layer's attention reads them back. `routing`: the MoE layers'
        forced / recorded routes and router statistics (`rlhf.models.moe.Routing`).
        """
        return self.run(inputs, position_ids_T, cu_seqlens, max_seqlen, layers=self.layers.keys(),
                        embed=self.embed_tokens is not None, norm=self.norm is not None,
                        prefix=prefix, layout=layout, routing=routing)

    def run(self, inputs: Tensor, position_ids_T: Tensor, cu_seqlens: Tensor, max_seqlen: int,
            *, layers: Iterable[str], embed: bool, norm: bool,
            prefix: SharedPrefix | None = None, layout: VarlenLayout | None = None,
            routing: Routing | None = None) -> Tensor:
        """The embedding (if `embed`), the named `layers` in order, the norm (if `norm`):
        one pipeline chunk of this part."""
        hidden_TH = self.embed_tokens(inputs) if embed else inputs
        if embed and self.embed_scale is not None:
            hidden_TH = hidden_TH * _rounded(self.embed_scale, hidden_TH.dtype)
        cos_TD, sin_TD = self.rotary_emb(position_ids_T, hidden_TH.dtype)
        for name in layers:
            hidden_TH = self.layers[name](hidden_TH, cos_TD, sin_TD, cu_seqlens, max_seqlen,
                                          prefix, layout, routing)
        return self.norm(hidden_TH) if norm else hidden_TH


def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as an fp32 scalar cast to `dtype` (transformers' rounding), on the host: a
    Python number, so multiplying by it copies nothing to the device."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


class _WithBody(nn.Module):
    """Shared constructor of the two model kinds: `self.model` plus stage flags."""

    def __init__(self, args: ModelArgs, *, layer_range: tuple[int, int] | None,
                 layer_ranges: Sequence[tuple[int, int]] | None, has_embedding: bool,
                 has_head: bool):
        super().__init__()
        self.args = args
        self.has_head = has_head
        self.model = Transformer(args, layer_range=layer_range, layer_ranges=layer_ranges,
                                 has_embedding=has_embedding, has_norm=has_head)
        self.fused = False  # the vocab head's chunks (rlhf.models.fused.apply_compile)

    @property
    def is_complete(self) -> bool:
        """Embedding, every layer and the head: a whole model, not a pipeline stage."""
        return (self.model.embed_tokens is not None and self.has_head
                and self.model.layer_range == (0, self.args.num_layers))

    def shared_parameters(self) -> dict[str, str]:
        """{name: name of the parameter it equals in the full model}: a pipeline keeps both
        copies (on different stages) identical by summing their grads."""
        return {}


class CausalLM(_WithBody):
    """Decoder plus LM head: forward gives logits_TV (hidden_TH on a stage without the head)."""

    def __init__(self, args: ModelArgs, *, layer_range: tuple[int, int] | None = None,
                 layer_ranges: Sequence[tuple[int, int]] | None = None,
                 has_embedding: bool = True, has_head: bool = True):
        super().__init__(args, layer_range=layer_range, layer_ranges=layer_ranges,
                         has_embedding=has_embedding, has_head=has_head)
        self.lm_head = (nn.Linear(args.hidden_size, args.vocab_size, bias=False) if has_head
                        else None)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when tied and both live here (re-run after swaps)."""
        if (self.args.tie_word_embeddings and self.lm_head is not None
                and self.model.embed_tokens is not None):
            self.lm_head.weight = self.model.embed_tokens.weight

    def shared_parameters(self) -> dict[str, str]:
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.args.tie_word_embeddings \
            else {}

    def head(self, hidden_TH: Tensor) -> Tensor:
        """hidden_TH (after the final norm) -> logits_TV."""
        return self.lm_head(hidden_TH)

    def forward(self, tokens_T: Tensor, position_ids_T: Tensor, cu_seqlens: Tensor,
                max_seqlen: int, *, prefix: SharedPrefix | None = None,
                layout: VarlenLayout | None = None, routing: Routing | None = None) -> Tensor:
        hidden_TH = self.model(tokens_T, position_ids_T, cu_seqlens, max_seqlen, prefix=prefix,
                               layout=layout, routing=routing)
        return self.head(hidden_TH) if self.lm_head is not None else hidden_TH


class ValueModel(_WithBody):
    """Decoder plus a scalar head (critic, reward model): forward gives values_T.

    The head is named `score` like HF's *ForSequenceClassification / *ForTokenClassification.
    """

    def __init__(self, args: ModelArgs, *, layer_range: tuple[int, int] | None = None,
                 layer_ranges: Sequence[tuple[int, int]] | None = None,
                 has_embedding: bool = True, has_head: bool = True):
        super().__init__(args, layer_range=layer_range, layer_ranges=layer_ranges,
                         has_embedding=has_embedding, has_head=has_head)
        self.score = nn.Linear(args.hidden_size, 1, bias=args.score_bias) if has_head else None

    def head(self, hidden_TH: Tensor) -> Tensor:
        """hidden_TH (after the final norm) -> values_T."""
        return self.score(hidden_TH).squeeze(-1)

    def forward(self, tokens_T: Tensor, position_ids_T: Tensor, cu_seqlens: Tensor,
                max_seqlen: int, *, prefix: SharedPrefix | None = None,
                layout: VarlenLayout | None = None, routing: Routing | None = None) -> Tensor:
        hidden_TH = self.model(tokens_T, position_ids_T, cu_seqlens, max_seqlen, prefix=prefix,
                               layout=layout, routing=routing)
        return self.head(hidden_TH) if self.score is not None else hidden_TH
