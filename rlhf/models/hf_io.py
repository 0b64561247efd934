"""Hugging Face safetensors folders <-> `CausalLM` / `ValueModel` parameters.

Our parameter names are HF's, so the mapping is the identity with three exceptions: a tied
LM head is stored once as the embedding, a value head ("score") may be absent from a
causal-LM folder (then it is initialised fresh), and a value model ignores `lm_head.weight`.
Loading reads each tensor, or only the slice a parallel layout asks for, straight from the files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from rlhf.errors import RLHFError
from rlhf.families import model_family
from rlhf.models.lora import is_lora_param
from rlhf.models.transformer import CausalLM, ValueModel

# A fresh value head is drawn from normal(0, VALUE_HEAD_INIT_STD), the usual HF initializer_range,
# by a CPU generator seeded with `value_head_seed`: the same on every device and TP layout.
VALUE_HEAD_INIT_STD = 0.02
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
T = TypeVar("T")
# Files copied next to the weights by write_hf_folder (tokenizer, chat template, generation).
_SIDE_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json",
               "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")

# (dim, start, stop): read tensor[start:stop] along dim instead of the whole tensor.
SliceSpec = tuple[int, int, int]
ShardFn = Callable[[str, tuple[int, ...]], SliceSpec | None]
Model = CausalLM | ValueModel


def load_hf_weights(model: Model, folder: str | Path, *, shard_fn: ShardFn | None = None,
                    value_head_seed: int = 0) -> list[str]:
    """Copy the checkpoint in `folder` into `model`'s (materialised) parameters.

    `shard_fn(param_name, full_shape)` may return (dim, start, stop) to read only that slice.
    A slice that ends at the tensor's end may be shorter than its parameter along `dim` (the
    last shards of a padded vocabulary): the parameter's remaining rows are zeroed.
    Layers, embedding or head absent from `model` (a pipeline stage) are skipped. Returns the
    parameters the checkpoint lacked and that were initialised instead (a fresh value head).
    """
    folder = Path(folder)
    files = _tensor_files(folder)
    full_shapes = _full_model_shapes(model)
    _check_unexpected(model, files, full_shapes, folder)
    reads, fresh = _reads(model, files, folder)
    params = dict(model.named_parameters())
    for file, pairs in reads.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name, source in pairs:
                tensor, pad_dim = _read(f, source, name, shard_fn)
                _copy(params[name], tensor, name, source, pad_dim=pad_dim)
    gen = torch.Generator().manual_seed(value_head_seed)
    for name in fresh:  # sorted: score.bias (zeros) then score.weight (random)
        full = torch.zeros(full_shapes[name])
        if name.endswith("weight"):
            full.normal_(0.0, VALUE_HEAD_INIT_STD, generator=gen)
        spec = shard_fn(name, tuple(full.shape)) if shard_fn else None
        _copy(params[name], _slice(full, spec), name, "fresh value head")
    return fresh


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt", device="cpu") as f:
            return {name: single for name in f.keys()}
    raise RLHFError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors "
                    f"checkpoints are supported")


def _full_model_shapes(model: Model) -> dict[str, tuple[int, ...]]:
    """Names and full shapes of the whole (unsharded, all-stage) model, built on meta."""
    with torch.device("meta"):
        full = type(model)(model.args)
    return {name: tuple(p.shape) for name, p in full.named_parameters()}


def _ignorable(model: Model, name: str) -> bool:
    return (name.endswith("rotary_emb.inv_freq")  # a buffer some old checkpoints saved
            or (name == "lm_head.weight"
                and (isinstance(model, ValueModel) or model.args.tie_word_embeddings)))


def _check_unexpected(model: Model, files: dict[str, Path], full_shapes: dict, folder: Path):
    unexpected = sorted(n for n in files if n not in full_shapes and not _ignorable(model, n))
    if unexpected:
        hint = ""
        if isinstance(model, CausalLM) and any(n.startswith("score.") for n in unexpected):
            hint = " (a value-head checkpoint: load it into a ValueModel)"
        raise RLHFError(f"{folder} has tensors a {model.args.model_type} {type(model).__name__} "
                        f"does not have{hint}: {_names(unexpected)}")


def _reads(model: Model, files: dict[str, Path], folder: Path):
    """({file: [(param name, checkpoint name)]}, [value-head params to initialise])."""
    reads: dict[Path, list[tuple[str, str]]] = {}
    missing, fresh = [], []
    has_score = any(n.startswith("score.") for n in files)
    for name, _ in model.named_parameters():
        if is_lora_param(name):
            continue  # adapters are not in a base folder: `rlhf.models.lora` initialises them
        source = name
        if name == "lm_head.weight" and model.args.tie_word_embeddings:
            source = "model.embed_tokens.weight"  # a last stage holding its own copy of the tie
        if source in files:
            reads.setdefault(files[source], []).append((name, source))
        elif isinstance(model, ValueModel) and name.startswith("score.") and not has_score:
            fresh.append(name)
        else:
            missing.append(source)
    if missing:
        hint = " (a causal-LM head is missing: is this a value-head folder?)" if (
            "lm_head.weight" in missing and has_score) else ""
        raise RLHFError(f"{folder} lacks tensors the model needs{hint}: {_names(missing)}")
    if isinstance(model, ValueModel) and "score.weight" in files:
        with safe_open(files["score.weight"], framework="pt", device="cpu") as f:
            rows = f.get_slice("score.weight").get_shape()[0]
        if rows != 1:
            raise RLHFError(f"{folder}: score.weight has {rows} rows (num_labels={rows}); a value "
                            f"head needs num_labels=1")
    return reads, sorted(fresh)


def _read(f, source: str, name: str, shard_fn: ShardFn | None) -> tuple[Tensor, int | None]:
    """The (sliced) tensor, and the dim along which the parameter may pad it (see _copy)."""
    tensor_slice = f.get_slice(source)
    full_shape = tuple(tensor_slice.get_shape())
    spec = shard_fn(name, full_shape) if shard_fn else None
    if spec is None:
        return tensor_slice[:], None
    dim, start, stop = spec
    pad_dim = dim if stop == full_shape[dim] else None
    return tensor_slice[(slice(None),) * dim + (slice(start, stop),)], pad_dim


def _slice(full: Tensor, spec: SliceSpec | None) -> Tensor:
    if spec is None:
        return full
    dim, start, stop = spec
    return full.narrow(dim, start, stop - start)


@torch.no_grad()
def _copy(param: Tensor, tensor: Tensor, name: str, source: str, *,
          pad_dim: int | None = None) -> None:
    """param <- tensor, shapes equal; or, along pad_dim only, tensor shorter and the rest zeroed."""
    got, want = tuple(tensor.shape), tuple(param.shape)
    if pad_dim is not None and got != want:
        others_match = got[:pad_dim] + got[pad_dim + 1:] == want[:pad_dim] + want[pad_dim + 1:]
        if others_match and got[pad_dim] < want[pad_dim]:
            param.narrow(pad_dim, got[pad_dim], want[pad_dim] - got[pad_dim]).zero_()
            param = param.narrow(pad_dim, 0, got[pad_dim])
    if tuple(param.shape) != got:
        raise RLHFError(f"{source} gives shape {got} but parameter {name} has "
                        f"shape {want}; check the config and the parallel layout")
    param.copy_(tensor)


def _names(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def bucketed(named: Iterable[tuple[str, Tensor]],
             bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """(name, tensor) pairs in order, grouped in buckets of at most `bucket_bytes` (a bigger
    tensor goes alone)."""
    return bucketed_by_size(((pair, pair[1].numel() * pair[1].element_size()) for pair in named),
                            bucket_bytes)


def bucketed_by_size(sized: Iterable[tuple[T, int]], bucket_bytes: int) -> Iterator[list[T]]:
    """Items in order, each given with its size in bytes, grouped in buckets of at most
    `bucket_bytes` (a bigger item goes alone); lazy, so the items may be streamed."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[T] = []
    size = 0
    for item, nbytes in sized:
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += nbytes
    if bucket:
        yield bucket


def write_hf_folder(folder: str | Path, buckets: Iterable[list[tuple[str, Tensor]]], *,
                    config_source: str | Path, config: dict) -> Path:
    """One safetensors file per bucket of HF-named full tensors (an index when there are
    several), `config` as config.json, and the tokenizer/generation files of `config_source`.

    The buckets are streamed: only one is held at a time, so they may come from a collective
    exporter (`export_full_hf_weights`).
    """
    folder, config_source = Path(folder), Path(config_source)
    folder.mkdir(parents=True, exist_ok=True)
    parts, total = [], 0  # (file written, names in it); final names need the file count
    for i, bucket in enumerate(buckets):
        tensors = {name: t.detach().contiguous().cpu() for name, t in bucket}
        part = folder / f".part-{i:05d}.safetensors"
        save_file(tensors, part, metadata={"format": "pt"})
        parts.append((part, list(tensors)))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    names = weight_file_names(len(parts))
    for (part, _), file in zip(parts, names):
        part.rename(folder / file)
    finish_hf_folder(folder, [(file, keys) for (_, keys), file in zip(parts, names)],
                     total_bytes=total, config_source=config_source, config=config)
    return folder


def weight_file_names(count: int) -> list[str]:
    """The names of a folder's `count` safetensors files, as transformers writes them."""
    return ([SINGLE_FILE] if count == 1 else
            [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])


def finish_hf_folder(folder: Path, files: list[tuple[str, list[str]]], *, total_bytes: int,
                     config_source: str | Path, config: dict) -> None:
    """Around the weight files of `folder` ((name, tensor names) each): the index when there
    are several, the tokenizer/generation files of `config_source`, `config` as config.json."""
    if len(files) > 1:
        weight_map = {key: file for file, keys in files for key in keys}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
    for pattern in _SIDE_FILES:
        for path in Path(config_source).glob(pattern):
            if path.is_file():
                shutil.copy2(path, folder / path.name)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def causal_lm_config(config_source: str | Path, *, dtype: torch.dtype) -> dict:
    """config.json of `config_source` for its family's causal LM with weights in `dtype` (what
    `hf_config` gives a CausalLM, without the model)."""
    config = _read_config(config_source)
    config["architectures"] = [model_family(config.get("model_type")).causal_lm_class]
    return _with_dtype(config, dtype)


def _read_config(config_source: str | Path) -> dict:
    return json.loads((Path(config_source) / "config.json").read_text(encoding="utf-8"))


def _with_dtype(config: dict, dtype: torch.dtype) -> dict:
    """`config` naming the weights' `dtype` as transformers does (no `torch_dtype` left)."""
    config.pop("torch_dtype", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    return config


def hf_config(model: Model, config_source: str | Path) -> dict:
    """config.json of `config_source` with the architecture and dtype of `model` (a whole model
    or any pipeline stage of it)."""
    dtype = next(model.parameters()).dtype
    if isinstance(model, CausalLM):
        return causal_lm_config(config_source, dtype=dtype)
    config = _read_config(config_source)
    if not str((config.get("architectures") or [""])[0]).endswith("Classification"):
        # A critic trained from a causal LM becomes a one-label sequence classifier.
        config["architectures"] = [f"{model.args.family.hf_prefix}ForSequenceClassification"]
        config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    return _with_dtype(config, dtype)
