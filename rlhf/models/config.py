"""`ModelArgs`: the architecture of a Llama-family model, read from a Hugging Face config.json.

Covers every model_type registered in `rlhf.families` (Llama, Qwen2, Qwen3, Mistral, and Qwen3's
decoder with sparse mixture-of-experts MLPs, `rlhf.models.moe`). Every field the decoder needs
is resolved here, with the defaults transformers itself applies when a key is absent (the
family's spec holds them), so the model code never looks at the raw config. Anything we do not
implement is refused with the key named.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch.nn.functional as F

from rlhf.errors import RLHFError
from rlhf.families import ModelFamily, model_family

SUPPORTED_ROPE_TYPES = ("default", "llama3")
# The gated MLP's activations the decoder implements, by transformers' ACT2FN names.
ACTIVATIONS: dict[str, Callable] = {"silu": F.silu, "gelu": F.gelu,
                                    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_SLIDING_WINDOW = 4096  # Mistral/Qwen config classes default to a 4096-token window
_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2/Qwen3: layers from this index on use the window


@dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float
    """Divisor of the low frequencies."""
    low_freq_factor: float
    """Wavelengths above original_max_position_embeddings / low_freq_factor get divided."""
    high_freq_factor: float
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int
    """Context length of pre-training, in tokens."""


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Shape and options of a Llama-family decoder; see `from_hf_config` / `from_pretrained`."""

    model_type: str
    """A family registered in `rlhf.families` (names the HF architecture on export)."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP."""
    num_layers: int
    """Decoder layers in the whole model (a pipeline stage builds a range of them)."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); divides num_heads."""
    head_dim: int
    """Size of one attention head."""
    hidden_act: str = "silu"
    """Activation of the gated MLP: down(act(gate(x)) * up(x))."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = _DEFAULT_ROPE_THETA
    """RoPE base."""
    rope_scaling: Llama3RopeScaling | None = None
    """None for plain RoPE."""
    max_position_embeddings: int = 2048
    """Longest sequence the model accepts."""
    tie_word_embeddings: bool = False
    """The LM head shares the embedding matrix."""
    qkv_bias: bool = False
    """q_proj, k_proj and v_proj have biases (qwen2; llama/qwen3 attention_bias)."""
    o_bias: bool = False
    """o_proj has a bias (llama/qwen3 attention_bias)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (qwen3)."""
    mlp_bias: bool = False
    """gate/up/down projections have biases (llama mlp_bias)."""
    score_bias: bool = False
    """The value head ("score") has a bias (HF *ForTokenClassification default)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model (every layer has the SwiGLU MLP)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Width of each expert's SwiGLU MLP."""
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to 1."""
    decoder_sparse_step: int = 1
    """Layer i is an MoE layer when (i + 1) % decoder_sparse_step == 0 (and not mlp-only)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep the dense MLP in an MoE model."""
    router_aux_loss_coef: float = 0.0
    """The checkpoint's weight of the router load-balancing loss (the default of the role's
    `router_aux_loss_coef`)."""

    def __post_init__(self):
        model_family(self.model_type)
        if self.hidden_act not in ACTIVATIONS:
            raise RLHFError(f"hidden_act {self.hidden_act!r} is not supported; supported: "
                            f"{', '.join(ACTIVATIONS)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise RLHFError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise RLHFError(f"num_attention_heads ({self.num_heads}) must be divisible by "
                            f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise RLHFError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise RLHFError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                                f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise RLHFError("moe_intermediate_size and decoder_sparse_step must be at least 1, "
                                f"got {self.moe_intermediate_size} and {self.decoder_sparse_step}")

    @property
    def family(self) -> ModelFamily:
        """The registered spec of `model_type` (norm style, embedding scale, HF names)."""
        return model_family(self.model_type)

    @property
    def is_moe(self) -> bool:
        """Some layer has a sparse mixture-of-experts MLP."""
        return any(self.is_moe_layer(i) for i in range(self.num_layers))

    def is_moe_layer(self, layer: int) -> bool:
        """Layer `layer` has a sparse MoE block rather than the dense MLP (transformers' rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelArgs:
        """Read `folder`/config.json."""
        path = Path(folder) / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RLHFError(f"{path} not found; point at a Hugging Face model folder") from None
        except (OSError, ValueError) as exc:
            raise RLHFError(f"cannot read {path}: {exc}") from None
        return cls.from_hf_config(config)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Resolve a config.json dict, applying transformers' defaults for absent keys."""
        family = model_family(config.get("model_type"))
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if not isinstance(config.get(key), int):
                raise RLHFError(f"config.json needs an integer {key}, got {config.get(key)!r}")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        max_pos = config.get("max_position_embeddings", family.max_position_embeddings)
        _check_sliding_window(config, family, max_pos)
        theta, scaling = _rope(config, max_pos)
        attention_bias = (family.attention_bias == "config"
                          and bool(config.get("attention_bias", False)))
        architectures = config.get("architectures") or [""]
        return cls(
            model_type=family.name,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=_head_dim(config, family, hidden, heads),
            hidden_act=_hidden_act(config, family),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(config.get("tie_word_embeddings",
                                                family.tie_word_embeddings)),
            qkv_bias=family.attention_bias == "qkv" or attention_bias,
            o_bias=attention_bias,
            qk_norm=family.qk_norm,
            mlp_bias=family.reads_mlp_bias and bool(config.get("mlp_bias", False)),
            score_bias=(architectures[0].endswith("ForTokenClassification")
                        and bool(config.get("token_classification_bias", True))),
            **(_moe_fields(config, family.moe_defaults) if family.moe_defaults is not None
               else {}),
        )


def _hidden_act(config: dict[str, Any], family: ModelFamily) -> str:
    act = config.get("hidden_act", family.hidden_act)
    return family.hidden_act_aliases.get(act, act)  # what its config class turns it into


def _moe_fields(config: dict[str, Any], defaults) -> dict[str, Any]:
    """The mixture-of-experts fields of an MoE config (saved with num_local_experts)."""
    get = {key: config.get(key, default) for key, default in defaults.items()}
    get["num_experts"] = config.get("num_experts", config.get("num_local_experts",
                                                             get["num_experts"]))
    return dict(num_experts=int(get["num_experts"]),
                num_experts_per_tok=int(get["num_experts_per_tok"]),
                moe_intermediate_size=int(get["moe_intermediate_size"]),
                norm_topk_prob=bool(get["norm_topk_prob"]),
                decoder_sparse_step=int(get["decoder_sparse_step"]),
                mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
                router_aux_loss_coef=float(get["router_aux_loss_coef"]))


def _head_dim(config: dict[str, Any], family: ModelFamily, hidden: int, heads: int) -> int:
    if config.get("head_dim") is not None:
        return config["head_dim"]
    if family.head_dim is not None and "head_dim" not in config:
        return family.head_dim  # the config class's default (Qwen3: 128), not hidden / heads
    if hidden % heads:
        raise RLHFError(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
                        f"and config.json has no head_dim")
    return hidden // heads


def _check_sliding_window(config: dict[str, Any], family: ModelFamily, max_pos: int) -> None:
    """Refuse a sliding window that could change attention: we only implement full attention."""
    if family.sliding_window == "never":
        return
    if family.sliding_window == "all_layers":
        window = config.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
        layers_with_window = list(range(config["num_hidden_layers"]))
    else:  # opt_in (Qwen): the window only with use_sliding_window, on "sliding_attention" layers
        if not config.get("use_sliding_window", False):
            return
        window = config.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
        first = config.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
        types = config.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention"
            for i in range(config["num_hidden_layers"])]
        layers_with_window = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if window is None or window >= max_pos or not layers_with_window:
        return
    where = ("all layers" if len(layers_with_window) == config["num_hidden_layers"]
             else f"layers {layers_with_window}")
    raise RLHFError(
        f"sliding_window={window} is active ({family.name}, {where}) and smaller than "
        f"max_position_embeddings={max_pos}, but sliding-window attention is not implemented. "
        f"If your sequences never exceed {window} tokens, set max_position_embeddings to "
        f"{window} in config.json (the window then never applies)")


def _rope(config: dict[str, Any], max_pos: int) -> tuple[float, Llama3RopeScaling | None]:
    """(theta, scaling) from rope_parameters (transformers 5) or legacy rope_scaling/rope_theta."""
    # Same precedence as transformers: a legacy rope_scaling dict wins over rope_parameters.
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise RLHFError(f"per-layer-type rope_parameters ({', '.join(params)}) are not supported")
    theta = float(params.get("rope_theta", config.get("rope_theta", _DEFAULT_ROPE_THETA)))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise RLHFError(f"partial_rotary_factor={partial} is not supported; only 1.0 (RoPE on the "
                        f"whole head)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise RLHFError(f"rope_parameters.rope_type {rope_type!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise RLHFError(f"rope_type 'llama3' needs rope_parameters.{', '.join(missing)}")
    # transformers prefers a top-level original_max_position_embeddings (Phi-3 style) if present.
    original = config.get("original_max_position_embeddings",
                          params.get("original_max_position_embeddings", max_pos))
    scaling = Llama3RopeScaling(
        factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original))
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise RLHFError(f"rope_parameters.high_freq_factor ({scaling.high_freq_factor}) must be "
                        f"greater than low_freq_factor ({scaling.low_freq_factor})")
    return theta, scaling
