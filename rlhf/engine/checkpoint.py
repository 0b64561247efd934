"""Engine checkpoints: one file per model-parallel rank, plus one per ZeRO-1 optimizer shard.

Data-parallel replicas hold bit-identical weights, so only dp rank 0 writes the file of its
(pp, tp) coordinate. Without ZeRO-1 the optimizer state is replicated too and goes in that
file; with ZeRO-1 each dp rank writes its own shard to `optim_pp.._tp.._dp...pt` and the main
file records how many shards there are. Loading at the same split reads one shard; at
another dp size (or with ZeRO-1 switched) every shard of the coordinate is read and
resharded. Each file is written to a temporary name, flushed to disk, then renamed into
place, so a crash never leaves a truncated checkpoint under the final name. With LoRA adapters
the model part holds the adapters only (the optimizer state is theirs already) and a
fingerprint of the frozen base, checked against model.path on resume (`model_state`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf.errors import RLHFError
from rlhf.files import atomic_write
from rlhf.models.lora import has_lora
from rlhf.parallel.mesh import ParallelMesh

FORMAT_VERSION = 2  # 2: flat (ZeRO-1 capable) optimizer state


def shard_file(folder: str | Path, mesh: ParallelMesh) -> Path:
    """The file of this rank's (pp, tp) coordinate inside `folder`."""
    return Path(folder) / f"engine_pp{mesh.pp_rank:02d}_tp{mesh.tp_rank:02d}.pt"


def optimizer_file(folder: str | Path, mesh: ParallelMesh, *, dp_rank: int | None = None) -> Path:
    """The file of a ZeRO-1 optimizer shard (this rank's by default) inside `folder`."""
    dp_rank = mesh.dp_rank if dp_rank is None else dp_rank
    return (Path(folder) /
            f"optim_pp{mesh.pp_rank:02d}_tp{mesh.tp_rank:02d}_dp{dp_rank:03d}.pt")


def layout(mesh: ParallelMesh) -> dict[str, int]:
    """What a shard file must match to be loadable on this rank."""
    return {"tp": mesh.tp_size, "pp": mesh.pp_size, "tp_rank": mesh.tp_rank,
            "pp_rank": mesh.pp_rank}


def save_shard(state: dict[str, Any], folder: str | Path, mesh: ParallelMesh) -> Path:
    """Write this rank's engine `state` (the model by dp rank 0 only, a ZeRO-1 optimizer
    shard by every dp rank); return once every file is on disk."""
    path = shard_file(folder, mesh)
    optim = state.get("optimizer")
    if optim is not None and optim["shards"] > 1:
        with atomic_write(optimizer_file(folder, mesh), "wb") as f:
            torch.save(optim, f)
        state = {**state, "optimizer": {"shards": optim["shards"], "sharded": True}}
    if mesh.dp_rank == 0:
        with atomic_write(path, "wb") as f:
            torch.save(state, f)
    # After the dp barrier my (pp, tp) file exists; after the mp barrier, every rank's does.
    dist.barrier(group=mesh.dp_group)
    dist.barrier(group=mesh.mp_group)
    return path


def load_shard(folder: str | Path, mesh: ParallelMesh, *, shards: int = 1) -> dict[str, Any]:
    """Read this rank's shard file into host memory and check that it was written for the same
    layout; the engine copies it into its own tensors (read straight onto the device, the
    state would be there twice while it is copied).

    `shards`: how many ways this engine splits its optimizer state. When the checkpoint's
    split differs (another dp size, or ZeRO-1 on one side only), its "optimizer" is
    {"shards": k, "all": [every saved shard of this (pp, tp) coordinate]} for resharding.
    """
    path = shard_file(folder, mesh)
    if not path.is_file():
        raise RLHFError(f"{path} does not exist; is {folder} an engine checkpoint written with "
                        f"tp={mesh.tp_size} pp={mesh.pp_size}?")
    state = torch.load(path, map_location="cpu", weights_only=True)
    check_layout(state, mesh, str(path))
    optim = state.get("optimizer")
    if optim is None or optim["shards"] == shards == 1:
        return state
    saved = optim["shards"]
    dp_ranks = [mesh.dp_rank] if saved == shards else range(saved)
    if not optim.get("sharded"):  # one replicated state, in this file
        parts = [optim]
    else:
        parts = []
        for dp_rank in dp_ranks:
            file = optimizer_file(folder, mesh, dp_rank=dp_rank)
            if not file.is_file():
                raise RLHFError(f"{file} is missing: {folder} holds optimizer state sharded "
                                f"over a data-parallel size of {saved} (ZeRO-1) and this "
                                f"engine runs dp={mesh.dp_size}; copy the whole checkpoint "
                                f"folder, or resume with dp={saved}")
            parts.append(torch.load(file, map_location="cpu", weights_only=True))
    state["optimizer"] = parts[0] if saved == shards else {"shards": saved, "all": parts}
    return state


def check_layout(state: dict[str, Any], mesh: ParallelMesh, where: str) -> None:
    """Refuse a state written for another format or model-parallel layout."""
    if state.get("format_version") != FORMAT_VERSION:
        raise RLHFError(f"{where} has format version {state.get('format_version')}; this engine "
                        f"reads version {FORMAT_VERSION}")
    got, want = state.get("layout"), layout(mesh)
    if got != want:
        raise RLHFError(f"{where} was written for {got} but this rank is {want}; engine "
                        "checkpoints reshard over data parallelism only, not over tp or pp: "
                        "resume with the same tp and pp, or start from an exported HF folder")


# ---- what a checkpoint keeps of the model ------------------------------------------------------

BASE_FINGERPRINT = "lora_base_fingerprint"  # key beside the adapters in a LoRA model state


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's model state for a checkpoint: every tensor, or with LoRA adapters only the
    trainable ones (the factors, a critic's value head) and a fingerprint of the frozen base,
    which a resume loads from model.path again."""
    state = model.state_dict()
    if not has_lora(model):
        return state
    trainable = _trainable(model)
    out = {name: t for name, t in state.items() if name in trainable}
    out[BASE_FINGERPRINT] = _fingerprint(state, trainable)
    return out


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load what `model_state` saved into `model` (built with the same layout and adapters);
    refuse a LoRA checkpoint whose frozen base differs from the one `model` holds."""
    if BASE_FINGERPRINT not in state:
        if has_lora(model):
            raise RLHFError(f"{where} holds full weights but this model trains LoRA adapters; "
                            "resume with the run's own lora settings (r = 0), or start a LoRA "
                            "run from an exported HF folder")
        model.load_state_dict(state)
        return
    if not has_lora(model):
        raise RLHFError(f"{where} holds LoRA adapters only, but this model has none; resume "
                        "with the run's lora settings")
    saved_trainable = {name: t for name, t in state.items() if name != BASE_FINGERPRINT}
    trainable = _trainable(model)
    if set(saved_trainable) != trainable:
        raise RLHFError(f"{where} has adapters for other modules than this model "
                        f"({len(saved_trainable)} tensors saved, {len(trainable)} trainable "
                        "here); resume with the run's lora.target_modules and r")
    saved, mine = state[BASE_FINGERPRINT], _fingerprint(model.state_dict(), trainable)
    if saved.shape != mine.shape or not torch.allclose(saved, mine, rtol=1e-6, atol=1e-8):
        raise RLHFError(f"{where} trained its adapters on another base than model.path holds "
                        "now (the frozen weights differ); resume with the model.path of the "
                        "run that wrote it")
    model.load_state_dict(saved_trainable, strict=False)


def _trainable(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _fingerprint(state: dict[str, torch.Tensor], trainable: set[str]) -> torch.Tensor:
    """(sum, sum of squares) of every frozen tensor, in float64 on the host: cheap to keep,
    and a different base (another model.path) moves it far beyond rounding."""
    rows = [torch.stack([t.double().sum(), t.double().square().sum()]).cpu()
            for name, t in state.items() if name not in trainable]
    return torch.stack(rows)
