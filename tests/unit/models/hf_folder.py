"""Saving a whole single-device model as an HF folder: a test helper over `write_hf_folder`,
the path the workers save through."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from torch import Tensor

from rlhf.errors import RLHFError
from rlhf.models.hf_io import INDEX_FILE, Model, bucketed, hf_config, write_hf_folder


def export_hf_weights(model: Model, *, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """HF-named full tensors in buckets of at most `bucket_bytes` (a bigger tensor goes alone).

    Tensors are detached views of the parameters, not copies. A tied LM head is not exported:
    HF checkpoints and vLLM take it from the embedding.
    """
    tied = model.args.tie_word_embeddings
    return bucketed(((name, param.detach()) for name, param in model.named_parameters()
                     if not (tied and name == "lm_head.weight")), bucket_bytes)


def save_hf_folder(model: Model, folder: str | Path, *, config_source: str | Path,
                   max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a folder transformers and vLLM load: config.json (from `config_source`, updated),
    safetensors shards, and the tokenizer/generation files of `config_source`."""
    folder = Path(folder)
    if not model.is_complete:
        raise RLHFError("save_hf_folder needs the whole model; this is a pipeline stage "
                        f"(layers {model.model.layer_range}); gather the stages first")
    if folder.is_dir() and (any(folder.glob("*.safetensors")) or (folder / INDEX_FILE).exists()):
        raise RLHFError(f"{folder} already holds weights; save into an empty folder")
    return write_hf_folder(folder, export_hf_weights(model, bucket_bytes=max_shard_bytes),
                           config_source=config_source, config=hf_config(model, config_source))
