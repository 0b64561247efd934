"""Checkpoint and export methods shared by the roles that own a training TrainEngine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from rlhf.controller import Dispatch, register

EXPORT_BUCKET_BYTES = 256 * 2**20
MAX_SHARD_BYTES = 4 * 2**30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")


class CheckpointMixin:
    """`save_checkpoint` / `load_checkpoint` of `self.engine` under one folder per role, and
    `export_hf` of its weights as a Hugging Face folder (any tp/pp layout)."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> str:
        """Write this rank's engine shard under `folder` (collective); returns the file."""
        return str(self.engine.save_checkpoint(Path(folder)))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        """Restore this rank's engine shard from `folder`, then run `_after_load`."""
        self.engine.load_checkpoint(Path(folder))
        self._after_load()

    def _after_load(self) -> None:
        """Hook for roles that cache something derived from the weights."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def export_hf(self, folder: str, config_source: str) -> str:
        """Write the full weights as safetensors shards (by the mesh's first rank; every rank
        takes part in the gathers), with config.json and tokenizer files of `config_source`."""
        mesh, folder = self.engine.mesh, Path(folder)
        writer = mesh.rank == mesh.ranks[0]
        files, shard, size, dtype = [], {}, 0, "float32"
        # Every rank runs the iterator to the end: the TP gathers / PP broadcasts are collective.
        for bucket in self.engine.export_hf_weights(bucket_bytes=EXPORT_BUCKET_BYTES):
            if not writer:
                continue
            for name, t in bucket:
                shard[name] = t.detach().contiguous().cpu().clone()
                size += t.numel() * t.element_size()
                dtype = str(t.dtype).removeprefix("torch.") if t.is_floating_point() else dtype
            if size >= MAX_SHARD_BYTES:
                files.append(_write_shard(folder, shard, len(files)))
                shard, size = {}, 0
        if writer:
            if shard or not files:
                files.append(_write_shard(folder, shard, len(files)))
            _finish_folder(folder, files, Path(config_source), dtype=dtype)
        dist.barrier(group=mesh.dp_group)
        dist.barrier(group=mesh.mp_group)
        return str(folder)


def _write_shard(folder: Path, tensors: dict, index: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"shard-{index:05d}.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def _finish_folder(folder: Path, files: list[Path], source: Path, *, dtype: str) -> None:
    """HF shard names (and an index when there are several), config.json, tokenizer files."""
    if len(files) == 1:
        files[0].rename(folder / "model.safetensors")
    else:
        weight_map, total = {}, 0
        for i, path in enumerate(files):
            name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            path.rename(folder / name)
            with safe_open(folder / name, framework="pt") as f:
                for key in f.keys():
                    weight_map[key] = name
                    total += f.get_tensor(key).nbytes
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2),
                                                             encoding="utf-8")
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) \
                and path.name != "config.json":
            shutil.copy2(path, folder / path.name)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config.pop("torch_dtype", None)
    config["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
