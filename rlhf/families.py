"""Model families: one `ModelFamily` spec per Hugging Face `model_type` the decoder implements.

Everything the rest of the code asks about a family is a field here: its Hugging Face class
names, the defaults transformers applies when config.json omits a key, which biases, norms and
activation the decoder builds, how its config turns on sliding windows or experts, and what the
tiny-model factory writes. The config (`model.tiny.arch`), the CLI's choices, the config
checks, `ModelArgs`, Hugging Face export, GGUF import and the demo factory all read `FAMILIES`;
adding a family is one entry below plus its tests (docs/guides/verify-model.md, "Adding a
model family").

This module is pure data (no torch, no transformers) and sits below `rlhf.config`, the lowest
layer that needs the names: the config validates `model.tiny.arch` against them, so the
registry cannot live in `rlhf.models`, which is above the config.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from rlhf.errors import RLHFError


def _frozen(**items: Any) -> Mapping[str, Any]:
    return MappingProxyType(items)


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """What the code needs to know about one Hugging Face decoder family."""

    name: str
    """config.json's model_type; also `model.tiny.arch` and `rlhf make-tiny-model --arch`."""
    hf_prefix: str
    """transformers' class prefix: `<prefix>Config`, `<prefix>ForCausalLM`,
    `<prefix>ForSequenceClassification`, `<prefix>ForTokenClassification`."""
    summary: str
    """A few words on what sets it apart, for help texts and docs."""
    max_position_embeddings: int
    """transformers' default when config.json omits max_position_embeddings."""
    head_dim: int | None = None
    """transformers' default head_dim when config.json omits the key; None: hidden / heads."""
    tie_word_embeddings: bool = False
    """transformers' default of tie_word_embeddings."""
    hidden_act: str = "silu"
    """transformers' default of hidden_act (the gated MLP's activation)."""
    hidden_act_aliases: Mapping[str, str] = field(default_factory=_frozen)
    """hidden_act values the config class replaces when it loads (Gemma: legacy "gelu")."""
    attention_bias: Literal["none", "qkv", "config"] = "none"
    """Attention biases: none; "qkv": q/k/v always, o_proj never (Qwen2); "config": q/k/v/o
    all follow config.json's attention_bias."""
    reads_mlp_bias: bool = False
    """The gated MLP's projections follow config.json's mlp_bias (Llama)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3). Its weight is replicated
    over TP and its grad partial (the parameter table reads `ModelArgs.qk_norm`)."""
    rms_norm: Literal["llama", "gemma"] = "llama"
    """"llama": weight * normed.to(dtype), weights stored around 1; "gemma": (normed * (1 +
    weight)) in fp32 then cast, weights stored around 0."""
    embed_scale: bool = False
    """The embedding output is multiplied by sqrt(hidden_size), rounded to the model's dtype."""
    sliding_window: Literal["never", "all_layers", "opt_in"] = "never"
    """How config.json turns on a sliding window: never; on every layer unless null (Mistral);
    only with use_sliding_window, on layers from max_window_layers (Qwen). We implement full
    attention only, so an active window smaller than the context is refused."""
    moe_defaults: Mapping[str, Any] | None = None
    """transformers' defaults of the mixture-of-experts keys; None: a dense family."""
    gguf_architecture: str | None = None
    """GGUF's general.architecture for this family; None: not imported from GGUF."""
    tiny_config: Mapping[str, Any] = field(default_factory=_frozen)
    """Extra keys the tiny-model factory passes to `<prefix>Config` (biases off, windows off)."""
    tiny_writes_head_dim: bool = True
    """The tiny-model factory writes head_dim (False where the config class has no such key)."""

    @property
    def is_moe(self) -> bool:
        """Its decoder layers hold sparse mixture-of-experts MLPs."""
        return self.moe_defaults is not None

    @property
    def causal_lm_class(self) -> str:
        return f"{self.hf_prefix}ForCausalLM"

    @property
    def norm_weight_center(self) -> float:
        """The stored RMSNorm weight that leaves a normalised input unscaled."""
        return 0.0 if self.rms_norm == "gemma" else 1.0


# Keys the tiny factory sets so a Qwen config never turns its window on.
_NO_QWEN_WINDOW = _frozen(use_sliding_window=False, sliding_window=None)

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="llama", hf_prefix="Llama", summary="Llama (optional attention and MLP biases)",
        max_position_embeddings=2048, attention_bias="config", reads_mlp_bias=True,
        gguf_architecture="llama", tiny_config=_frozen(attention_bias=False, mlp_bias=False)),
    ModelFamily(
        name="qwen2", hf_prefix="Qwen2", summary="Qwen2 (q/k/v biases)",
        max_position_embeddings=32768, attention_bias="qkv", sliding_window="opt_in",
        gguf_architecture="qwen2", tiny_config=_NO_QWEN_WINDOW,
        tiny_writes_head_dim=False),  # Qwen2's head size is always hidden / heads
    ModelFamily(
        name="qwen3", hf_prefix="Qwen3", summary="Qwen3 (q/k norm)",
        max_position_embeddings=32768, head_dim=128, attention_bias="config", qk_norm=True,
        sliding_window="opt_in", gguf_architecture="qwen3",
        tiny_config=_frozen(attention_bias=False, **_NO_QWEN_WINDOW)),
    ModelFamily(
        # GGUF files of Mistral models say "llama", and import as that family.
        name="mistral", hf_prefix="Mistral", summary="Mistral (no biases)",
        max_position_embeddings=131072, sliding_window="all_layers",
        tiny_config=_frozen(sliding_window=None)),
    ModelFamily(
        name="qwen3_moe", hf_prefix="Qwen3Moe", summary="Qwen3 with mixture-of-experts MLPs",
        max_position_embeddings=32768, attention_bias="config", qk_norm=True,
        sliding_window="opt_in", gguf_architecture="qwen3_moe",
        moe_defaults=_frozen(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                             norm_topk_prob=False, decoder_sparse_step=1,
                             router_aux_loss_coef=0.001),
        tiny_config=_frozen(attention_bias=False, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], **_NO_QWEN_WINDOW)),
    ModelFamily(
        name="gemma", hf_prefix="Gemma",
        summary="Gemma (GeGLU, (1 + w) RMSNorm, sqrt(hidden) embedding scale, tied)",
        max_position_embeddings=8192, head_dim=256, tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh", hidden_act_aliases=_frozen(gelu="gelu_pytorch_tanh"),
        # No gguf_architecture: transformers reads Gemma 2 and 3 GGUF files, not Gemma's.
        attention_bias="config", rms_norm="gemma", embed_scale=True,
        # vLLM reads hidden_activation (hidden_act alone makes it warn, then use the same tanh).
        tiny_config=_frozen(attention_bias=False, hidden_activation="gelu_pytorch_tanh")),
)
FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
_BY_NAME = {f.name: f for f in FAMILIES}


def find_family(model_type: object) -> ModelFamily | None:
    """The family registered as `model_type`, or None."""
    return _BY_NAME.get(model_type) if isinstance(model_type, str) else None


def model_family(model_type: object, *, what: str = "model_type",
                 error: type[RLHFError] = RLHFError) -> ModelFamily:
    """The family registered as `model_type`; `error` naming the registered ones if none."""
    found = find_family(model_type)
    if found is None:
        close = difflib.get_close_matches(str(model_type), FAMILY_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise error(f"{what} {model_type!r} is not supported{hint}; supported: "
                        f"{', '.join(FAMILY_NAMES)}")
    return found
