"""Shape of a tiny random-init model that the project builds itself (no model hub needed)."""

from dataclasses import dataclass
from typing import Literal

from rlhf.errors import ConfigError

# vLLM's CPU attention kernels only exist for these head sizes.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Byte-level BPE needs its 256-symbol alphabet plus the special tokens before any merge.
MIN_TINY_VOCAB = 320


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """A Llama-family model small enough to train on two CPU cores."""

    arch: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama"
    """Model family: llama, qwen2 (qkv bias), qwen3 (q/k norm) or mistral."""
    num_layers: int = 4
    """Number of transformer layers."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention heads; hidden_size / num_heads is the head size (vLLM on CPU needs >= 32)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = 256
    """Width of the SwiGLU MLP."""
    vocab_size: int = 512
    """Embedding rows; the trained tokenizer has at most this many tokens."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + response) the model accepts."""
    seed: int = 0
    """Seed of the random weights and of the tokenizer's training text."""

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.arch not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ConfigError(f"arch must be one of llama, qwen2, qwen3, mistral; got {self.arch!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                             f"({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.vocab_size < MIN_TINY_VOCAB:
            raise ConfigError(f"vocab_size must be at least {MIN_TINY_VOCAB} (byte-level BPE "
                             f"alphabet plus special tokens), got {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads
