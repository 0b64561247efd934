"""The few numbers of a model's architecture that the config checks need."""

import json
from dataclasses import dataclass
from pathlib import Path

from rlhf.config.tiny import TinyModelConfig
from rlhf.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """Shape of a model as far as parallel plans and sequence lengths care."""

    source: str
    """Where the numbers come from, for messages (a config.json path or 'model.tiny')."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int


def read_model_facts(path: str | None, tiny: TinyModelConfig | None, key: str) -> ModelFacts | None:
    """Facts from `path`/config.json if the folder exists, else from `tiny`, else None.

    `key` is the dotted config key of `path`, for messages.
    """
    folder = Path(path) if path else None
    if folder is not None and folder.exists():
        return _facts_from_json(folder / "config.json", key)
    if tiny is None:
        return None
    return ModelFacts(source="model.tiny", num_layers=tiny.num_layers, num_heads=tiny.num_heads,
                      num_kv_heads=tiny.num_kv_heads, head_dim=tiny.head_dim,
                      intermediate_size=tiny.intermediate_size,
                      max_position_embeddings=tiny.max_position_embeddings)


def _facts_from_json(config_json: Path, key: str) -> ModelFacts:
    try:
        hf = json.loads(config_json.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{key}: {str(config_json.parent)!r} exists but has no config.json; "
                          f"point {key} at a Hugging Face model folder") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot read {str(config_json)!r}: {exc}") from None
    required = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size",
                "max_position_embeddings")
    missing = [name for name in required if not isinstance(hf.get(name), int)]
    if missing:
        raise ConfigError(f"{key}: {str(config_json)!r} lacks integer {', '.join(missing)}; "
                          f"is it a Llama-family model?")
    heads = hf["num_attention_heads"]
    return ModelFacts(source=str(config_json), num_layers=hf["num_hidden_layers"],
                      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                      intermediate_size=hf["intermediate_size"],
                      max_position_embeddings=hf["max_position_embeddings"])
