"""Engine checkpoints through torch.distributed.checkpoint (DCP), loadable into any layout.

Every tensor is written as the GLOBAL tensor it is a slice of, keyed by its HF name: a weight
of full HF shape (a padded vocabulary cut back to its real size), its Adam moments and, for a
low-precision model, its fp32 master. Each rank describes the boxes of those global tensors it
holds (`_chunks`, read from the model's `ParamTable`): its TP slice of a weight; for the
optimizer state, the pieces of its ZeRO-1 flat partition, each cut into the few rectangular
boxes a row-major range of a tensor makes (`flat_boxes`), so a partition that cuts across
parameters needs no gather. DCP's planner writes each box once (replicas and the dp copies of
unsharded state are deduplicated; a tied LM head is its embedding and is not written) into
one file per rank, with a `.metadata` file listing every box of every tensor. Loading asks
for the boxes this rank holds in ITS layout and DCP reads the overlapping parts of the saved
ones: tp, pp, vpp, dp (ZeRO-1 on or off) and ep may all differ from the run that saved.

A save is planned collectively (`start_engine_save`), then each rank writes its data file in
the foreground or, with `background`, in a thread from a host copy of its boxes while the
engine trains on; `EngineWrite.finish` (collective) waits for the writes and writes DCP's
metadata. Every file is hashed (size, sha256) from the bytes as they are written
(`_HashingFileSystem`), for the checkpoint's manifest.

`engine.json` (format_version 3) holds the step and the layout that wrote the checkpoint.
With LoRA adapters only the trainable tensors are written, plus a (sum, sum of squares)
fingerprint of each frozen base tensor (global, so any layout can check it) against which a
resume checks that model.path still holds the same base.

Checkpoints of format 2 (files per (pp, tp) and per dp rank, resharded over dp only) are still
read by `load_shard` below, for resumes of runs saved before DCP.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from rlhf.engine.optim import ShardedAdamW
from rlhf.errors import RLHFError
from rlhf.files import atomic_folder, atomic_write
from rlhf.models.hf_io import (
    bucketed_by_size,
    causal_lm_config,
    finish_hf_folder,
    weight_file_names,
)
from rlhf.models.lora import has_lora
from rlhf.models.param_table import ParamInfo, ParamTable
from rlhf.parallel.mesh import ParallelMesh

FORMAT_VERSION = 3  # 3: DCP, global tensors by HF name (any layout); 2: per-(pp, tp) files
ENGINE_FILE = "engine.json"  # the step and the layout that wrote a format-3 checkpoint
# Key prefixes of the global tensors in a format-3 checkpoint, before the HF name.
WEIGHTS, EXP_AVG, EXP_AVG_SQ, MASTER, LORA_BASE = ("model/", "optim/exp_avg/",
                                                   "optim/exp_avg_sq/", "optim/master/",
                                                   "lora_base/")


def checkpoint_format(folder: str | Path) -> int:
    """3 when `folder` holds a DCP engine checkpoint, 2 for one from before (files per (pp, tp)
    coordinate); RLHFError when it holds neither."""
    folder = Path(folder)
    if (folder / ENGINE_FILE).is_file():
        return FORMAT_VERSION
    if folder.is_dir() and any(folder.glob("engine_pp*_tp*.pt")):
        return FORMAT_VERSION_2
    raise RLHFError(f"{folder} does not exist or holds no engine checkpoint (no {ENGINE_FILE}, "
                    "no engine_pp.._tp...pt files); give the role's folder of a checkpoint, "
                    "OUTPUT_DIR/checkpoints/step_N/ROLE")


# ---- which boxes of which global tensors this rank holds ---------------------------------------

@dataclass(frozen=True)
class Chunk:
    """A box of the global tensor `key` (of shape `size`) at `offsets`: `tensor`, a view of
    this rank's storage with the box's shape (written from on save, read into on load)."""

    key: str
    offsets: tuple[int, ...]
    size: tuple[int, ...]
    tensor: Tensor


def flat_boxes(shape: Sequence[int], start: int, stop: int
               ) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The range [start, stop) of a row-major tensor of `shape`, flattened, as rectangular
    boxes (flat start, offsets, sizes), in order: each is a contiguous run of the range (a
    partial row, whole rows, a partial row, recursively); at most 2 * ndim - 1 of them."""
    if start >= stop:
        return []
    if not shape:
        return [(start, (), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if start % inner == 0 and stop % inner == 0:
        return [(start, (first, *[0] * (len(shape) - 1)), (last - first + 1, *shape[1:]))]
    out = []
    lo = start
    if start % inner:  # the partial row the range starts in
        hi = min(stop, (first + 1) * inner)
        out += [(lo + a - start % inner, (first, *offs), (1, *sizes))
                for a, offs, sizes in flat_boxes(shape[1:], start % inner, hi - first * inner)]
        lo = hi
    whole = stop // inner * inner
    if lo < whole:  # whole rows
        out.append((lo, (lo // inner, *[0] * (len(shape) - 1)),
                    ((whole - lo) // inner, *shape[1:])))
        lo = whole
    if lo < stop:  # the partial row it ends in
        row = lo // inner
        out += [(lo + a, (row, *offs), (1, *sizes))
                for a, offs, sizes in flat_boxes(shape[1:], 0, stop - lo)]
    return out


def _to_global(entry: ParamInfo, local_shape: Sequence[int], offsets: Sequence[int],
               view: Tensor, tp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...],
                                                    Tensor] | None:
    """(global offsets, global shape, view cut to real entries) of a box at local `offsets`
    of a parameter; None when it lies wholly in the padding of a padded vocabulary."""
    size, offsets = list(local_shape), list(offsets)
    if entry.shard is None:
        return tuple(offsets), tuple(size), view
    dim, full = entry.shard.dim, entry.shard.full_size
    start = tp_rank * local_shape[dim] + offsets[dim]  # padding is only ever at the end
    count = min(view.shape[dim], full - start)
    if count <= 0:
        return None
    offsets[dim], size[dim] = start, full
    return tuple(offsets), tuple(size), view.narrow(dim, 0, count)


def _chunks(model: torch.nn.Module, table: ParamTable, mesh: ParallelMesh,
            optimizers: Sequence[tuple[Sequence[int], ShardedAdamW]], *, weights_from: str = WEIGHTS
            ) -> list[Chunk]:
    """Every box this rank holds: its TP slice of each weight (LoRA: trainable ones only; a
    tied copy under its original's name, read but never written twice) and its ZeRO-1 pieces
    of each moment and master. `weights_from`: the key prefix the weights use (a run in fp32
    loads them from a low-precision run's masters)."""
    params = list(model.parameters())  # the table's order
    lora = has_lora(model)
    out = []
    for entry, param in zip(table, params):
        if lora and not entry.trainable:
            continue
        placed = _to_global(entry, param.shape, [0] * param.dim(), param.detach(), mesh.tp_rank)
        if placed is not None:
            offsets, size, view = placed
            out.append(Chunk(weights_from + entry.hf_name, offsets, size, view))
    for ids, optimizer in optimizers:
        states = [(EXP_AVG, optimizer.exp_avg), (EXP_AVG_SQ, optimizer.exp_avg_sq)]
        if optimizer.master is not None:
            states.append((MASTER, optimizer.master))
        for piece in optimizer.pieces:
            entry, param = table.entries[ids[piece.param]], params[ids[piece.param]]
            for flat_start, offsets, sizes in flat_boxes(param.shape, piece.start, piece.stop):
                at = piece.shard_start + flat_start - piece.start
                for prefix, flat in states:
                    view = flat[at:at + math.prod(sizes)].view(sizes)
                    placed = _to_global(entry, param.shape, offsets, view, mesh.tp_rank)
                    if placed is not None:
                        out.append(Chunk(prefix + entry.hf_name, *placed))
    return out


# ---- DCP planners over those boxes -------------------------------------------------------------

class _BoxSavePlanner(SavePlanner):
    """Writes the given boxes; the coordinator dedups replicas and checks that every global
    tensor is covered exactly once."""

    def __init__(self, chunks: Sequence[Chunk]):
        self.chunks = {(c.key, c.offsets): c for c in chunks}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([WriteItem(
            index=MetadataIndex(c.key, torch.Size(c.offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets),
                                           sizes=c.tensor.shape),
                properties=TensorProperties.create_from_tensor(c.tensor),
                size=torch.Size(c.size))) for c in self.chunks.values()])
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(dedup_save_plans(all_plans))
        for key, md in metadata.state_dict_metadata.items():
            assert isinstance(md, TensorStorageMetadata)
            held = sum(math.prod(c.sizes) for c in md.chunks)
            if held != math.prod(md.size):  # a gap or an overlap: a bug in `_chunks`
                raise RuntimeError(f"the ranks hold {held} entries of {key} of shape "
                                   f"{tuple(md.size)}; the checkpoint would not be whole")
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Tensor:
        return self.chunks[(write_item.index.fqn, tuple(write_item.index.offset or ()))].tensor


class _BoxLoadPlanner(LoadPlanner):
    """Reads into the given boxes whatever overlaps them in the checkpoint; refuses a key the
    checkpoint lacks, another global shape, or a box it does not cover entirely."""

    def __init__(self, chunks: Sequence[Chunk], *, where: str):
        self.by_key: dict[str, list[Chunk]] = {}
        for c in chunks:
            self.by_key.setdefault(c.key, []).append(c)
        self.where = where

    def set_up_planner(self, state_dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        assert metadata is not None
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        saved, items = self.metadata.state_dict_metadata, []
        for key, chunks in self.by_key.items():
            md = saved.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise RLHFError(f"{self.where} has no tensor {key}: it was saved from another "
                                "model, head or LoRA setting; resume with the run's own model "
                                "and lora settings")
            if tuple(md.size) != chunks[0].size:
                raise RLHFError(f"{self.where} holds {key} of shape {tuple(md.size)} but this "
                                f"model's is {chunks[0].size}; resume with the same model")
            local = [ChunkStorageMetadata(torch.Size(c.offsets), c.tensor.shape) for c in chunks]
            reads = create_read_items_for_chunk_list(key, md, local)
            for i, c in enumerate(chunks):
                got = sum(math.prod(r.lengths) for r in reads if r.dest_index.index == i)
                if got != c.tensor.numel():
                    raise RLHFError(f"{self.where} holds {got} of the {c.tensor.numel()} "
                                    f"entries of {key} this rank needs; the checkpoint is not "
                                    "whole (copy the whole folder)")
            items += reads
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise RLHFError(f"{self.where} holds a non-tensor entry {read_item.dest_index.fqn}; "
                        "it was not written by this engine")

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        index = read_item.dest_index
        assert index.index is not None
        tensor = self.by_key[index.fqn][index.index].tensor
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination itself


# ---- save: hashed as written, in the foreground or a background thread -------------------------

class _HashedStream(io.RawIOBase):
    """A file being written whose bytes are hashed (sha256) and counted as they pass."""

    def __init__(self, raw: Any):
        self.raw, self.digest, self.size = raw, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.digest.update(view)
        self.size += view.nbytes
        return self.raw.write(view)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.flush()  # the file itself closes with `create_stream`


class _HashingFileSystem(FileSystem):
    """DCP's file system, recording each file it writes as {"size", "sha256"} by name, from the
    bytes as they are written (a rename carries the record): the manifest never re-reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, dict[str, Any]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashed = _HashedStream(stream)
            yield cast(io.IOBase, hashed)
        self.digests[Path(path).name] = {"size": hashed.size, "sha256": hashed.digest.hexdigest()}

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if (digest := self.digests.pop(Path(path).name, None)) is not None:
            self.digests[Path(new_path).name] = digest


class EngineWrite:
    """One rank's part of an engine save once its plan is made: its data file written in the
    foreground, or in a background thread from a host copy of its boxes (`background`).
    `finish()` (collective over the mesh) waits for it and writes DCP's metadata."""

    def __init__(self, folder: Path, *, mesh: ParallelMesh, index: int, planner: _BoxSavePlanner,
                 writer: FileSystemWriter, fs: _HashingFileSystem, plan: SavePlan,
                 metadata: Metadata, began: float, background: bool):
        self.folder, self.mesh, self.index = folder, mesh, index
        self.writer, self.fs, self.metadata, self.began = writer, fs, metadata, began
        self.results: list[Any] = []
        self.error: str | None = None
        self.written_at: float | None = None
        self.thread: threading.Thread | None = None
        if background:
            self.thread = threading.Thread(target=self._write, args=(planner, plan),
                                           name=f"checkpoint-writer {folder.name}", daemon=True)
            self.thread.start()
        else:
            self._write(planner, plan)
            if self.error is not None:  # the foreground write raises where it failed
                raise RLHFError(f"writing {folder} failed: {self.error}")

    def _write(self, planner: _BoxSavePlanner, plan: SavePlan) -> None:
        try:
            written = self.writer.write_data(plan, planner)
            written.wait()
            self.results = written.value()
        except Exception as e:  # noqa: BLE001 - carried to finish(), which every rank reaches
            self.error = f"{type(e).__name__}: {e}"
        self.written_at = time.monotonic()

    def done(self) -> bool:
        """Whether this rank's data file is written (or its write failed); no collective."""
        return self.written_at is not None

    def finish(self) -> dict[str, Any]:
        """Wait for every rank's data file, then write the metadata (the first rank); return
        {"files": {name: {"size", "sha256"}} of this rank's files, "write_s": seconds from the
        save's start until its data file was on disk}. RLHFError naming the ranks whose write
        failed (on every rank, so none waits for the others)."""
        if self.thread is not None:
            self.thread.join()
        outcomes = _all_gather((self.results, self.error), self.mesh)
        failed = [f"mesh rank {i}: {error}" for i, (_, error) in enumerate(outcomes) if error]
        if failed:
            raise RLHFError(f"writing the engine checkpoint {self.folder} failed ("
                            f"{'; '.join(failed)}); it is not complete and is not published")
        if self.index == 0:
            self.writer.finish(metadata=self.metadata, results=[r for r, _ in outcomes])
        _all_gather(None, self.mesh)  # no rank returns before the metadata is on disk
        assert self.written_at is not None
        return {"files": dict(self.fs.digests), "write_s": self.written_at - self.began}


def start_engine_save(folder: str | Path, *, model: torch.nn.Module, table: ParamTable,
                      mesh: ParallelMesh,
                      optimizers: Sequence[tuple[Sequence[int], ShardedAdamW]], step: int,
                      background: bool = False) -> EngineWrite:
    """Plan the save of this rank's boxes into `folder` (collective over the mesh) and write
    them: now, or with `background` from a host copy made now, in a thread, so the engine may
    train on while they are written. Every rank then calls `finish()` on the result."""
    began = time.monotonic()
    folder = Path(folder)
    chunks = _chunks(model, table, mesh, optimizers)
    lora = has_lora(model)
    if lora:
        chunks += _base_fingerprints(model, table, mesh)
    index = _mesh_index(mesh)
    fs = _HashingFileSystem()
    if index == 0:
        folder.mkdir(parents=True, exist_ok=True)
        info = {"format_version": FORMAT_VERSION, "step": step, "lora": lora,
                "masters": any(o.master is not None for _, o in optimizers),
                "layout": {"tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size,
                           "ep": mesh.ep_size,
                           "zero1": [o.part.shards for _, o in optimizers]}}
        data = json.dumps(info, indent=1).encode()
        with atomic_write(folder / ENGINE_FILE, "wb") as f:
            f.write(data)
        fs.digests[ENGINE_FILE] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    writer = FileSystemWriter(folder, thread_count=1)
    writer.fs = fs
    planner = _BoxSavePlanner(chunks)
    plan, metadata = _dcp_plan(planner, writer, mesh, index=index)
    if background:
        planner = _BoxSavePlanner(_staged(chunks))
    return EngineWrite(folder, mesh=mesh, index=index, planner=planner, writer=writer, fs=fs,
                       plan=plan, metadata=metadata, began=began, background=background)


def save_engine(folder: str | Path, *, model: torch.nn.Module, table: ParamTable,
                mesh: ParallelMesh, optimizers: Sequence[tuple[Sequence[int], ShardedAdamW]],
                step: int) -> Path:
    """Write this rank's boxes of the engine state into `folder` (collective over the mesh);
    return `folder`/engine.json once every rank's files and the metadata are on disk."""
    start_engine_save(folder, model=model, table=table, mesh=mesh, optimizers=optimizers,
                      step=step).finish()
    return Path(folder) / ENGINE_FILE


def _staged(chunks: Sequence[Chunk]) -> list[Chunk]:
    """The boxes copied to host memory (pinned from a GPU): what a background write reads while
    the engine changes its own tensors."""
    staged = []
    for c in chunks:
        host = torch.empty(c.tensor.shape, dtype=c.tensor.dtype, device="cpu",
                           pin_memory=c.tensor.is_cuda)
        host.copy_(c.tensor.detach(), non_blocking=c.tensor.is_cuda)
        staged.append(Chunk(c.key, c.offsets, c.size, host))
    if any(c.tensor.is_cuda for c in chunks):
        torch.cuda.synchronize()
    return staged


def _dcp_plan(planner: _BoxSavePlanner, writer: FileSystemWriter, mesh: ParallelMesh, *,
              index: int) -> tuple[SavePlan, Metadata]:
    """DCP's save protocol up to the writes (local plans, one global plan; the writes and the
    metadata by the first rank follow in `EngineWrite`), with the plans exchanged over the
    mesh's own groups: `dcp.save` wants one group spanning the mesh, which a mesh over part of
    the job's ranks does not have. Returns this rank's plan and the metadata to complete."""
    coordinator = index == 0
    planner.set_up_planner({}, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
    writer.set_up_storage_writer(coordinator, rank=index)
    with warnings.catch_warnings():  # a re-save into the same folder replaces it: expected
        warnings.filterwarnings("ignore", "Detected an existing checkpoint")
        local = writer.prepare_local_plan(planner.create_local_plan())
    # Every rank makes the (deterministic) global plan from every local one and takes its own.
    plans, metadata = planner.create_global_plan(_all_gather(local, mesh))
    plans = writer.prepare_global_plan(plans)
    return planner.finish_plan(plans[index]), metadata


def _all_gather(obj: Any, mesh: ParallelMesh) -> list[Any]:
    """Every mesh rank's `obj`, in `_mesh_index` order (object all-gathers over mp, then dp x cp)."""
    line: list[Any] = [None] * len(mesh.group_ranks("mp"))
    dist.all_gather_object(line, obj, group=mesh.mp_group)
    lines: list[Any] = [None] * len(mesh.group_ranks("dp_cp"))
    dist.all_gather_object(lines, line, group=mesh.dp_cp_group)
    return [item for part in lines for item in part]


def _mesh_index(mesh: ParallelMesh) -> int:
    """This rank's place in `_all_gather`'s order: its dp x cp rank, then its mp rank."""
    mp = mesh.group_ranks("mp")
    return mesh.group_ranks("dp_cp").index(mesh.rank) * len(mp) + mp.index(mesh.rank)


def read_engine_info(folder: str | Path) -> dict[str, Any]:
    """engine.json of a format-3 checkpoint, its version checked."""
    path = Path(folder) / ENGINE_FILE
    info = json.loads(path.read_text(encoding="utf-8"))
    if info.get("format_version") != FORMAT_VERSION:
        raise RLHFError(f"{path} has format version {info.get('format_version')}; this engine "
                        f"reads versions 2 and {FORMAT_VERSION}")
    return info


@torch.no_grad()
def load_engine(folder: str | Path, *, model: torch.nn.Module, table: ParamTable,
                mesh: ParallelMesh, optimizers: Sequence[tuple[Sequence[int], ShardedAdamW]]
                ) -> int:
    """Read into this rank's tensors the boxes it holds in its own layout from a format-3
    checkpoint in `folder` (any layout saved it; no collective); return the saved step."""
    folder = Path(folder)
    info = read_engine_info(folder)
    where = str(folder)
    lora = has_lora(model)
    if info["lora"] != lora:
        raise RLHFError(f"{where} holds {'LoRA adapters only' if info['lora'] else 'full weights'}"
                        f" but this model {'trains LoRA adapters' if lora else 'has none'}; "
                        "resume with the run's own lora settings")
    # An fp32 engine is its own master: it takes a low-precision run's fp32 masters as weights.
    from_masters = info["masters"] and all(o.master is None for _, o in optimizers)
    chunks = _chunks(model, table, mesh, optimizers)
    if from_masters:  # the trainable weights from the masters, frozen ones (if any) as saved
        trainable = {WEIGHTS + e.hf_name for e in table if e.trainable}
        chunks = [Chunk(MASTER + c.key[len(WEIGHTS):], c.offsets, c.size,
                        c.tensor) if c.key in trainable else c for c in chunks]
    # Without saved masters a low-precision engine takes them from the weights (below).
    chunks = [c for c in chunks if info["masters"] or not c.key.startswith(MASTER)]
    fingerprints = _base_fingerprints(model, table, mesh) if lora else []
    saved_prints = [Chunk(c.key, c.offsets, c.size, torch.empty_like(c.tensor))
                    for c in fingerprints]
    reader = FileSystemReader(folder)
    _check_data_files(reader.read_metadata(), folder)
    with warnings.catch_warnings():  # no_dist: each rank reads its own boxes, no collective
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp_load({}, storage_reader=reader,
                 planner=_BoxLoadPlanner(chunks + saved_prints, where=where), no_dist=True)
    for mine, saved in zip(fingerprints, saved_prints):
        if not torch.allclose(saved.tensor, mine.tensor, rtol=1e-6, atol=1e-8):
            raise RLHFError(f"{where} trained its adapters on another base than model.path "
                            f"holds now ({mine.key[len(LORA_BASE):]} differs); resume with the "
                            "model.path of the run that wrote it")
    for _, optimizer in optimizers:
        if not info["masters"]:
            optimizer.copy_from_model()
    return int(info["step"])


def _check_data_files(metadata: Metadata, folder: Path) -> None:
    """RLHFError naming a data file the metadata lists that is missing or shorter than the
    boxes it holds (a copy of part of the folder, a truncated file)."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        path = folder / name
        if not path.is_file():
            raise RLHFError(f"{path} is missing: the checkpoint's metadata lists boxes in it; "
                            "copy the whole checkpoint folder")
        if path.stat().st_size < size:
            raise RLHFError(f"{path} has {path.stat().st_size} bytes but holds boxes up to byte "
                            f"{size} (truncated?); resume from another checkpoint")


def _base_fingerprints(model: torch.nn.Module, table: ParamTable, mesh: ParallelMesh
                       ) -> list[Chunk]:
    """(sum, sum of squares) in float64 of each frozen global tensor this rank holds part of,
    as boxes of `lora_base/` keys (collective over TP: a split tensor's parts are summed)."""
    params = list(model.parameters())
    sums, keys, split = [], [], []
    for entry, param in zip(table, params):
        if entry.trainable or entry.tied_copy:
            continue
        placed = _to_global(entry, param.shape, [0] * param.dim(), param.detach(), mesh.tp_rank)
        real = placed[2] if placed is not None else param.detach()[:0]
        sums.append(torch.stack([real.double().sum(), real.double().square().sum()]))
        keys.append(LORA_BASE + entry.hf_name)
        split.append(entry.shard is not None)
    if not sums:
        return []
    stacked = torch.stack(sums)  # (n, 2)
    if mesh.tp_size > 1 and any(split):
        mask = torch.tensor(split, device=stacked.device)[:, None]
        parts = torch.where(mask, stacked, torch.zeros_like(stacked))
        dist.all_reduce(parts, group=mesh.tp_group)
        stacked = torch.where(mask, parts, stacked)
    stacked = stacked.cpu()
    return [Chunk(key, (0,), (2,), stacked[i].clone()) for i, key in enumerate(keys)]


# ---- HF export from the checkpoint's own metadata -----------------------------------------------
# The weights of a format-3 checkpoint are the HF tensors (full shapes, HF names, no tied copy):
# an export plans its files from the metadata and each process writes its share of them, reading
# only those tensors, one file at a time: no training layout, no devices, no model built.


def hf_export_plan(folder: str | Path, *, bucket_bytes: int) -> list[tuple[str, list[str]]]:
    """(file name, HF names) of each safetensors file an HF export of the weights in `folder`
    writes: its `model/` tensors in buckets of at most `bucket_bytes` (a bigger one alone)."""
    folder = Path(folder)
    if read_engine_info(folder)["lora"]:
        raise RLHFError(f"{folder} holds LoRA adapters only; their export needs the base model "
                        "(rlhf export-hf loads it on the workers)")
    saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    buckets = list(bucketed_by_size(
        ((key[len(WEIGHTS):], math.prod(md.size) * md.properties.dtype.itemsize)
         for key, md in saved.items()
         if key.startswith(WEIGHTS) and isinstance(md, TensorStorageMetadata)), bucket_bytes))
    return list(zip(weight_file_names(len(buckets)), buckets))


@torch.no_grad()
def write_hf_weight_files(folder: str | Path, out: str | Path,
                          plan: Sequence[tuple[str, list[str]]], part: int = 0, *,
                          parts: int = 1) -> int:
    """Write the files of `plan` (`hf_export_plan`) that fall to `part` of `parts` (every
    `parts`-th) into `out`, each read whole from checkpoint `folder`; return their bytes."""
    folder, out = Path(folder), Path(out)
    metadata = FileSystemReader(folder).read_metadata()
    _check_data_files(metadata, folder)
    saved, written = metadata.state_dict_metadata, 0
    for file, names in list(plan)[part::parts]:
        chunks = []
        for name in names:
            md = saved[WEIGHTS + name]
            assert isinstance(md, TensorStorageMetadata)
            tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            chunks.append(Chunk(WEIGHTS + name, (0,) * tensor.dim(), tuple(md.size), tensor))
        with warnings.catch_warnings():  # no_dist: no collective, each process its own files
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp_load({}, storage_reader=FileSystemReader(folder),
                     planner=_BoxLoadPlanner(chunks, where=str(folder)), no_dist=True)
        save_file({c.key[len(WEIGHTS):]: c.tensor for c in chunks}, str(out / file),
                  metadata={"format": "pt"})
        written += sum(c.tensor.numel() * c.tensor.element_size() for c in chunks)
    return written


def export_hf_folder(folder: str | Path, out: str | Path, *, config_source: str | Path,
                     bucket_bytes: int, processes: int = 1) -> Path:
    """An HF folder of the weights of format-3 checkpoint `folder`, written through a temporary
    folder that replaces `out` whole: `processes` processes (spawned when more than one) each
    write their share of the files, then the index, config and tokenizer files of
    `config_source` are added."""
    folder, out = Path(folder), Path(out)
    plan = hf_export_plan(folder, bucket_bytes=bucket_bytes)
    with atomic_folder(out) as tmp:
        if processes == 1:
            total = write_hf_weight_files(folder, tmp, plan)
        else:
            with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
                total = sum(pool.map(functools.partial(write_hf_weight_files, folder, tmp, plan,
                                                       parts=processes),
                                     range(processes)))
        saved = FileSystemReader(folder).read_metadata().state_dict_metadata
        dtypes = Counter(md.properties.dtype for key, md in saved.items()
                         if key.startswith(WEIGHTS) and isinstance(md, TensorStorageMetadata))
        finish_hf_folder(tmp, plan, total_bytes=total, config_source=config_source,
                         config=causal_lm_config(config_source, dtype=dtypes.most_common(1)[0][0]))
    return out


# ---- format 2 (read only): files per (pp, tp) coordinate and per ZeRO-1 shard ------------------
# One file per model-parallel rank, written by dp rank 0, plus one per ZeRO-1 optimizer shard;
# at ep > 1 the routed experts in files per ep rank. They reshard over dp (and edp) only.


FORMAT_VERSION_2 = 2  # files per (pp, tp) and per dp rank; flat (ZeRO-1 capable) optimizer


def shard_file(folder: str | Path, mesh: ParallelMesh) -> Path:
    """The file of this rank's (pp, tp) coordinate inside `folder`."""
    return Path(folder) / f"engine_pp{mesh.pp_rank:02d}_tp{mesh.tp_rank:02d}.pt"


def expert_file(folder: str | Path, mesh: ParallelMesh) -> Path:
    """The file of this rank's routed experts (its (pp, tp, ep rank)) inside `folder`."""
    return (Path(folder) /
            f"experts_pp{mesh.pp_rank:02d}_tp{mesh.tp_rank:02d}_ep{mesh.ep_rank:03d}.pt")


def optimizer_file(folder: str | Path, mesh: ParallelMesh, *, dp_rank: int | None = None) -> Path:
    """The file of a ZeRO-1 optimizer shard (this rank's by default) inside `folder`."""
    dp_rank = mesh.dp_rank if dp_rank is None else dp_rank
    return (Path(folder) /
            f"optim_pp{mesh.pp_rank:02d}_tp{mesh.tp_rank:02d}_dp{dp_rank:03d}.pt")


def expert_optimizer_file(folder: str | Path, mesh: ParallelMesh, *,
                          edp_rank: int | None = None) -> Path:
    """The file of a ZeRO-1 shard of this rank's experts' optimizer (over edp) inside `folder`."""
    edp_rank = mesh.edp_rank if edp_rank is None else edp_rank
    return (Path(folder) / f"optim_pp{mesh.pp_rank:02d}_tp{mesh.tp_rank:02d}"
            f"_ep{mesh.ep_rank:03d}_edp{edp_rank:03d}.pt")


EXPERTS_KEY = "experts"  # an engine state's part of the routed experts at ep > 1 (own files)


def layout(mesh: ParallelMesh) -> dict[str, int]:
    """What a shard file must match to be loadable on this rank."""
    return {"tp": mesh.tp_size, "pp": mesh.pp_size, "tp_rank": mesh.tp_rank,
            "pp_rank": mesh.pp_rank}


def header(mesh: ParallelMesh) -> dict[str, Any]:
    """The keys `check_layout` reads, for a state (or its experts' part) written on `mesh`."""
    return {"format_version": FORMAT_VERSION_2, "layout": layout(mesh), "ep": mesh.ep_size}


def load_shard(folder: str | Path, mesh: ParallelMesh, *, shards: int = 1,
               expert_shards: int = 1) -> dict[str, Any]:
    """Read this rank's shard file into host memory and check that it was written for the same
    layout; the engine copies it into its own tensors (read straight onto the device, the
    state would be there twice while it is copied).

    `shards`: how many ways this engine splits its optimizer state. When the checkpoint's
    split differs (another dp size, or ZeRO-1 on one side only), its "optimizer" is
    {"shards": k, "all": [every saved shard of this (pp, tp) coordinate]} for resharding.
    At ep > 1 the state's "experts" part is read from this ep rank's file, its optimizer split
    `expert_shards` ways over edp (resharded likewise).
    """
    path = shard_file(folder, mesh)
    state = _load_part(path, folder, mesh)
    state["optimizer"] = _optimizer_parts(
        state.get("optimizer"), shards, rank=mesh.dp_rank, dp_per_shard=1, folder=folder,
        mesh=mesh, file=lambda r: optimizer_file(folder, mesh, dp_rank=r))
    if state.pop(EXPERTS_KEY, False):
        experts = _load_part(expert_file(folder, mesh), folder, mesh)
        experts["optimizer"] = _optimizer_parts(
            experts.get("optimizer"), expert_shards, rank=mesh.edp_rank,
            dp_per_shard=mesh.ep_size, folder=folder, mesh=mesh,
            file=lambda r: expert_optimizer_file(folder, mesh, edp_rank=r))
        state[EXPERTS_KEY] = experts
    return state


def _load_part(path: Path, folder: str | Path, mesh: ParallelMesh) -> dict[str, Any]:
    if not path.is_file():
        ep = f" ep={mesh.ep_size}" if mesh.ep_size > 1 else ""
        raise RLHFError(f"{path} does not exist; is {folder} an engine checkpoint written with "
                        f"tp={mesh.tp_size} pp={mesh.pp_size}{ep}?")
    state = torch.load(path, map_location="cpu", weights_only=True)
    check_layout(state, mesh, str(path))
    return state


def _optimizer_parts(optim: dict[str, Any] | None, shards: int, *, rank: int, dp_per_shard: int,
                     folder: str | Path, mesh: ParallelMesh,
                     file: Callable[[int], Path]) -> dict[str, Any] | None:
    """The optimizer state this rank loads: its own shard when the split is the same, else
    {"shards": k, "all": [the k saved shards]} to reshard; `file(r)` holds saved shard r.
    `dp_per_shard`: dp ranks per shard rank (ep for the experts, which shard over edp)."""
    if optim is None or optim["shards"] == shards == 1:
        return optim
    saved = optim["shards"]
    if not optim.get("sharded"):  # one replicated state, in this file
        parts = [optim]
    else:
        parts = []
        for r in [rank] if saved == shards else range(saved):
            path = file(r)
            if not path.is_file():
                raise RLHFError(f"{path} is missing: {folder} holds optimizer state sharded "
                                f"over a data-parallel size of {saved * dp_per_shard} (ZeRO-1) "
                                f"and this engine runs dp={mesh.dp_size}; copy the whole "
                                f"checkpoint folder, or resume with dp={saved * dp_per_shard}")
            parts.append(torch.load(path, map_location="cpu", weights_only=True))
    return parts[0] if saved == shards else {"shards": saved, "all": parts}


def check_layout(state: dict[str, Any], mesh: ParallelMesh, where: str) -> None:
    """Refuse a state written for another format or model-parallel layout."""
    if state.get("format_version") != FORMAT_VERSION_2:
        raise RLHFError(f"{where} has format version {state.get('format_version')}; this engine "
                        f"reads version {FORMAT_VERSION_2}")
    saved_ep = state.get("ep", 1)
    if saved_ep != mesh.ep_size:
        raise RLHFError(f"{where} was written at expert parallelism ep={saved_ep} but this "
                        f"engine runs ep={mesh.ep_size}; each ep rank's routed experts are in "
                        f"files of their own, which do not reshard over ep: resume with "
                        f"ep={saved_ep}, or export HF weights (rlhf export-hf) and start from "
                        "that folder")
    got, want = state.get("layout"), layout(mesh)
    if got != want:
        raise RLHFError(f"{where} was written for {got} but this rank is {want}; engine "
                        "checkpoints reshard over data parallelism only, not over tp or pp: "
                        "resume with the same tp and pp, or start from an exported HF folder")


# ---- what a checkpoint keeps of the model ------------------------------------------------------

BASE_FINGERPRINT = "lora_base_fingerprint"  # key beside the adapters in a LoRA model state


def model_state(model: torch.nn.Module, *,
                keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """This rank's model state for a checkpoint: every tensor, or with LoRA adapters only the
    trainable ones (the factors, a critic's value head) and a fingerprint of the frozen base,
    which a resume loads from model.path again. `keep`: only the tensors it accepts."""
    state = _kept(model.state_dict(), keep)
    if not has_lora(model):
        return state
    trainable = _trainable(model, keep)
    out = {name: t for name, t in state.items() if name in trainable}
    out[BASE_FINGERPRINT] = _fingerprint(state, trainable)
    return out


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str, *,
                     keep: Callable[[str], bool] | None = None) -> None:
    """Load what `model_state` saved (with the same `keep`) into `model` (built with the same
    layout and adapters); refuse a LoRA checkpoint whose frozen base differs from the one
    `model` holds."""
    if BASE_FINGERPRINT not in state:
        if has_lora(model):
            raise RLHFError(f"{where} holds full weights but this model trains LoRA adapters; "
                            "resume with the run's own lora settings (r = 0), or start a LoRA "
                            "run from an exported HF folder")
        if keep is None:
            model.load_state_dict(state)
            return
        mine = set(_kept(model.state_dict(), keep))
        if set(state) != mine:
            raise RLHFError(f"{where} holds other tensors than this model part "
                            f"({len(state)} saved, {len(mine)} here); resume with the model "
                            "and layout of the run that wrote it")
        model.load_state_dict(state, strict=False)
        return
    if not has_lora(model):
        raise RLHFError(f"{where} holds LoRA adapters only, but this model has none; resume "
                        "with the run's lora settings")
    saved_trainable = {name: t for name, t in state.items() if name != BASE_FINGERPRINT}
    trainable = _trainable(model, keep)
    if set(saved_trainable) != trainable:
        raise RLHFError(f"{where} has adapters for other modules than this model "
                        f"({len(saved_trainable)} tensors saved, {len(trainable)} trainable "
                        "here); resume with the run's lora.target_modules and r")
    saved, mine = state[BASE_FINGERPRINT], _fingerprint(_kept(model.state_dict(), keep),
                                                        trainable)
    if saved.shape != mine.shape or not torch.allclose(saved, mine, rtol=1e-6, atol=1e-8):
        raise RLHFError(f"{where} trained its adapters on another base than model.path holds "
                        "now (the frozen weights differ); resume with the model.path of the "
                        "run that wrote it")
    model.load_state_dict(saved_trainable, strict=False)


def _kept(state: dict[str, torch.Tensor], keep: Callable[[str], bool] | None
          ) -> dict[str, torch.Tensor]:
    return state if keep is None else {name: t for name, t in state.items() if keep(name)}


def _trainable(model: torch.nn.Module, keep: Callable[[str], bool] | None = None) -> set[str]:
    return {name for name, p in model.named_parameters()
            if p.requires_grad and (keep is None or keep(name))}


def _fingerprint(state: dict[str, torch.Tensor], trainable: set[str]) -> torch.Tensor:
    """(sum, sum of squares) of every frozen tensor, in float64 on the host: cheap to keep,
    and a different base (another model.path) moves it far beyond rounding."""
    rows = [torch.stack([t.double().sum(), t.double().square().sum()]).cpu()
            for name, t in state.items() if name not in trainable]
    return torch.stack(rows)
