"""Engine checkpoints: one file per model-parallel rank, written atomically.

Data-parallel replicas hold bit-identical weights and optimizer state (their gradients are
all-reduced), so only dp rank 0 writes; every rank reads the file of its (pp, tp) coordinate.
A file is written to a temporary name, flushed to disk, then renamed into place, so a crash
never leaves a truncated checkpoint under the final name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf.errors import RLHFError
from rlhf.files import atomic_write
from rlhf.parallel.mesh import ParallelMesh

FORMAT_VERSION = 1


def shard_file(folder: str | Path, mesh: ParallelMesh) -> Path:
    """The file of this rank's (pp, tp) coordinate inside `folder`."""
    return Path(folder) / f"engine_pp{mesh.pp_rank:02d}_tp{mesh.tp_rank:02d}.pt"


def layout(mesh: ParallelMesh) -> dict[str, int]:
    """What a shard file must match to be loadable on this rank."""
    return {"tp": mesh.tp_size, "pp": mesh.pp_size, "tp_rank": mesh.tp_rank,
            "pp_rank": mesh.pp_rank}


def save_shard(state: dict[str, Any], folder: str | Path, mesh: ParallelMesh) -> Path:
    """Write this rank's engine `state` (dp rank 0 only); return once every shard is on disk."""
    path = shard_file(folder, mesh)
    if mesh.dp_rank == 0:
        with atomic_write(path, "wb") as f:
            torch.save(state, f)
    # After the dp barrier my (pp, tp) file exists; after the mp barrier, every rank's does.
    dist.barrier(group=mesh.dp_group)
    dist.barrier(group=mesh.mp_group)
    return path


def load_shard(folder: str | Path, mesh: ParallelMesh, *, device) -> dict[str, Any]:
    """Read this rank's shard file and check that it was written for the same layout."""
    path = shard_file(folder, mesh)
    if not path.is_file():
        raise RLHFError(f"{path} does not exist; is {folder} an engine checkpoint written with "
                        f"tp={mesh.tp_size} pp={mesh.pp_size}?")
    state = torch.load(path, map_location=device, weights_only=True)
    check_layout(state, mesh, str(path))
    return state


def check_layout(state: dict[str, Any], mesh: ParallelMesh, where: str) -> None:
    """Refuse a state written for another format or model-parallel layout."""
    if state.get("format_version") != FORMAT_VERSION:
        raise RLHFError(f"{where} has format version {state.get('format_version')}; this engine "
                        f"reads version {FORMAT_VERSION}")
    got, want = state.get("layout"), layout(mesh)
    if got != want:
        raise RLHFError(f"{where} was written for {got} but this rank is {want}; engine "
                        "checkpoints do not reshard: resume with the same tp and pp, or start "
                        "from an exported HF folder")
