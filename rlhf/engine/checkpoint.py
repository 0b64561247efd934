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

At ep > 1 the ranks of an expert-parallel group hold different routed experts: the (pp, tp)
file keeps the dense part, and each ep rank's edp rank 0 writes its experts (model state, and
optimizer state unless ZeRO-1 shards it over edp: then every edp rank writes its shard) to
`experts_pp.._tp.._ep...pt`. The expert optimizer reshards over edp as the dense one does over
dp; another ep is refused (the experts would move between files).
"""

from __future__ import annotations

from collections.abc import Callable
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
    return {"format_version": FORMAT_VERSION, "layout": layout(mesh), "ep": mesh.ep_size}


def save_shard(state: dict[str, Any], folder: str | Path, mesh: ParallelMesh) -> Path:
    """Write this rank's engine `state` (the model by dp rank 0 only, a ZeRO-1 optimizer
    shard by every dp rank; its "experts" part per ep rank); return once every file is on
    disk."""
    path = shard_file(folder, mesh)
    experts = state.get(EXPERTS_KEY)
    main = {**state, EXPERTS_KEY: experts is not None}  # whether expert files go with it
    _save_part(main, path, optimizer_file(folder, mesh), writes=mesh.dp_rank == 0)
    if experts is not None:
        _save_part(experts, expert_file(folder, mesh), expert_optimizer_file(folder, mesh),
                   writes=mesh.edp_rank == 0)
    # After the dp barrier my (pp, tp) files exist (ep and edp lie inside dp); after the mp
    # barrier, every rank's do.
    dist.barrier(group=mesh.dp_group)
    dist.barrier(group=mesh.mp_group)
    return path


def _save_part(part: dict[str, Any], path: Path, optim_path: Path, *, writes: bool) -> None:
    """Write a ZeRO-1 optimizer shard of `part` to `optim_path` (every rank of its group), the
    rest to `path` when this rank `writes` it (rank 0 of the group)."""
    optim = part.get("optimizer")
    if optim is not None and optim["shards"] > 1:
        with atomic_write(optim_path, "wb") as f:
            torch.save(optim, f)
        part = {**part, "optimizer": {"shards": optim["shards"], "sharded": True}}
    if writes:
        with atomic_write(path, "wb") as f:
            torch.save(part, f)


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
    if state.get("format_version") != FORMAT_VERSION:
        raise RLHFError(f"{where} has format version {state.get('format_version')}; this engine "
                        f"reads version {FORMAT_VERSION}")
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
