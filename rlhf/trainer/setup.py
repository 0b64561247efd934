"""What a job needs before its workers start: the model folder and the tokenizer."""

from __future__ import annotations

from pathlib import Path

from rlhf.config import TinyModelConfig
from rlhf.errors import RLHFError


def ensure_model(path: str | Path, tiny: TinyModelConfig | None) -> Path:
    """`path`, built from `tiny` (model.tiny) first when it holds no config.json."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    if tiny is None:
        raise RLHFError(f"{path} holds no model (no config.json); point model.path at a Hugging "
                        "Face folder, or set model.tiny to build a tiny one there")
    from rlhf.models.tiny import make_tiny_model

    print(f"building a tiny {tiny.arch} model in {path}", flush=True)
    return Path(make_tiny_model(tiny, path))


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer of a local folder (never looked up on a model hub)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise RLHFError(f"tokenizer folder {str(path)!r} does not exist; set model.tokenizer_path "
                        "or model.path to a local folder")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
