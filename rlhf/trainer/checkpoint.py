"""Checkpoints under OUTPUT_DIR/checkpoints/step_N, each complete or absent, each verifiable.

A checkpoint is assembled in a hidden temporary folder (engine files of each role, then the
driver's trainer_state.pt, then manifest.json listing every file with its size, its sha256
and a quick digest) and renamed to step_N as a whole, so a crash while saving never leaves a
partial step_N and never touches the previous ones. With `background` the engine files are
written by threads on the ranks while training goes on, and the folder is published (state,
manifest, rename) once they are all on disk; the sha256 of every file the ranks write is
recorded from the bytes as they are written, so the manifest reads back only quick digests.
Loading checks the manifest first, before any rank reads a file: every file's size and quick
digest (`quick_digest`: the file's size and sampled blocks, a few MiB read whatever the file's
size), or with `full_hash` every byte's sha256. A truncated or corrupted file is reported by
path, and `resume=auto` falls back to the newest checkpoint that verifies.
"""
from __future__ import annotations

import hashlib
import io
import json
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf.config.roles import TRAINED_ROLES
from rlhf.errors import RLHFError
from rlhf.files import atomic_folder, atomic_write

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d+)")
_CHUNK = 1 << 20
# quick_digest reads QUICK_BLOCKS blocks of QUICK_BLOCK bytes spread over a file (all of a
# smaller one): the headers and ends of every file, and a sample of its middle.
QUICK_BLOCK, QUICK_BLOCKS = 1 << 16, 64
_HASH_THREADS = 8  # hashlib releases the GIL on big updates: files hash in parallel



# ---- what makes two training runs the same run ----
# A manifest stores the config a checkpoint was written with and a fingerprint of RUN_KEYS;
# resuming compares them with the new config (rlhf.trainer.run_folder). The layout is not among
# them: the step plan makes the same optimizer steps from the same samples at any dp size, and
# engine checkpoints (rlhf.engine.checkpoint, DCP) hold global tensors that load into any tp,
# pp, vpp, ep and dp. Only a role saved in format 2 (files per (pp, tp) coordinate, before
# DCP) reads its files by coordinate, so a change of its MODEL_PARALLEL_KEYS is refused on its
# own (`layout_differences` over `fixed_layout_roles`), not overridable.

RUN_KEYS = (
    "model.path", "model.tokenizer_path",
    "algorithm.adv_estimator", "algorithm.kl_in_reward", "algorithm.use_kl_loss",
    "reward.functions", "reward.model_path",
    "data.train_files", "data.prompt_key", "data.ground_truth_key",
    "critic.model_path",
    "actor.placement", "critic.placement",
)
MODEL_PARALLEL_KEYS = ("tp", "pp", "vpp", "layers_per_stage", "ep")
_ABSENT = "<absent>"


def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def run_fingerprint(config: dict) -> str:
    """sha256 of the RUN_KEYS values of a config dict (as written by config_to_dict)."""
    identity = {key: _get(config, key) for key in RUN_KEYS}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def config_differences(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for every RUN_KEYS entry that differs."""
    lines = []
    for key in RUN_KEYS:
        old, new = _get(saved, key), _get(current, key)
        if old != new:
            lines.append(f"{key}: {_short(old)} -> {_short(new)}")
    return lines


def fixed_layout_roles(folder: Path) -> list[str]:
    """The roles of checkpoint `folder` that must resume at their saved model-parallel layout:
    those not saved through DCP (no engine.json: format 2, which reshards over dp only)."""
    # Here, not at the top: the driver's checks would otherwise import the model stack.
    from rlhf.engine.checkpoint import ENGINE_FILE

    return sorted(p.name for p in Path(folder).iterdir()
                  if p.is_dir() and not (p / ENGINE_FILE).is_file())


def layout_differences(saved: dict, current: dict, *,
                       roles: Sequence[str] = TRAINED_ROLES) -> list[str]:
    """'actor: tp=1 pp=1 -> tp=2 pp=1' for each of `roles` whose model-parallel layout differs
    between the config a checkpoint was `saved` with and the `current` one."""
    lines = []
    for role in roles:
        old, new = _get(saved, f"{role}.parallel"), _get(current, f"{role}.parallel")
        if not isinstance(old, dict) or not isinstance(new, dict):
            continue
        if any(old.get(k) != new.get(k) for k in MODEL_PARALLEL_KEYS):
            shown = [k for k in MODEL_PARALLEL_KEYS  # tp, pp and what is set on either side
                     if k in ("tp", "pp") or {old.get(k), new.get(k)} - {None, 1}]
            lines.append(f"{role}: {_layout(old, shown)} -> {_layout(new, shown)}")
    return lines


def _layout(parallel: dict, keys: Sequence[str]) -> str:
    return " ".join(f"{k}={json.dumps(parallel.get(k, 1))}" for k in keys)


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def model_config_digest(config: dict) -> str | None:
    """sha256 of model.path/config.json (None when absent): the same path may hold another
    model (e.g. another layer count) by the time a run resumes."""
    path = _get(config, "model.path")
    if not isinstance(path, str):
        return None
    try:
        return hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest()
    except OSError:
        return None


def rng_state() -> dict:
    """The driver's random generators."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (checkpoint shards may be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def quick_digest(path: Path) -> str:
    """Hex sha256 of a file's size and of QUICK_BLOCKS blocks spread evenly over it, the first
    and the last included (the whole file when it is that small): a few MiB read per file."""
    size = path.stat().st_size
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= QUICK_BLOCK * QUICK_BLOCKS:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
            return digest.hexdigest()
        last = size - QUICK_BLOCK
        for i in range(QUICK_BLOCKS):
            f.seek(last * i // (QUICK_BLOCKS - 1))
            digest.update(f.read(QUICK_BLOCK))
    return digest.hexdigest()


def _digests(path: Path, known: dict | None = None) -> dict:
    """A file's size, sha256 and quick digest; the sha256 from `known` (recorded from the bytes
    as they were written) when its size is the one `known` says."""
    size = path.stat().st_size
    if known is not None and known["size"] == size:
        return {"size": size, "sha256": known["sha256"], "quick": quick_digest(path)}
    return {"size": size, "sha256": file_sha256(path), "quick": quick_digest(path)}


def write_manifest(folder: Path, *, step: int, config: dict,
                   known: dict[str, dict] | None = None) -> None:
    """manifest.json: every file under `folder` (size, sha256, quick digest), the step, the
    run's config. `known`: {relative name: {"size", "sha256"}} hashed as they were written,
    not read again but for their quick digests. Files are hashed in parallel threads."""
    known = known or {}
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p != folder / MANIFEST]
    names = [p.relative_to(folder).as_posix() for p in paths]
    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
        digests = list(pool.map(_digests, paths, [known.get(n) for n in names]))
    manifest = {"step": step, "config_fingerprint": run_fingerprint(config),
                "model_config_sha256": model_config_digest(config), "config": config,
                "files": dict(zip(names, digests))}
    with atomic_write(folder / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)


def read_manifest(folder: Path) -> dict:
    """A checkpoint's manifest (call verify_checkpoint first to know it is sound)."""
    return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))


def verify_checkpoint(folder: Path, *, full_hash: bool = False) -> str | None:
    """None when every file of the manifest is there with its size and quick digest (with
    `full_hash`, or for a manifest from before quick digests: its sha256), else the first
    problem, naming the file (e.g. 'actor/__0_0.distcp hash mismatch')."""
    try:
        files = read_manifest(folder)["files"]
    except FileNotFoundError:
        return (f"no {MANIFEST} (a save that did not finish, or a folder made by hand or by an "
                "older version)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, want in files.items():  # sizes first: a missing or cut file costs no reading
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']} (truncated?)"

    def problem(item: tuple[str, dict]) -> str | None:
        name, want = item
        if full_hash or "quick" not in want:
            same = file_sha256(folder / name) == want["sha256"]
        else:
            same = quick_digest(folder / name) == want["quick"]
        return None if same else f"{name} hash mismatch (its bytes changed after the save)"

    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
        return next((p for p in pool.map(problem, files.items()) if p is not None), None)


def _take_files(written: dict[str, dict], role: str, results: Sequence[dict | None]) -> float:
    """Add the files of `role`'s ranks (as `EngineWrite.finish` returns them; None from a rank
    whose write is not finished) to `written` under `role`; return the slowest rank's write
    seconds (0 when none reported)."""
    write_s = 0.0
    for result in results:
        if result is None:
            continue
        for name, digest in result["files"].items():
            written[f"{role}/{name}"] = digest
        write_s = max(write_s, float(result["write_s"]))
    return write_s


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class _Pending:
    """A save whose engine files are being written in the background."""

    step: int
    stack: ExitStack  # holds the atomic folder open: closed, it publishes step_N
    tmp: Path
    roles: Mapping[str, Any]  # see `CheckpointManager.save`
    state: bytes
    config: dict
    began: float
    blocked_s: float  # the training loop's seconds in this save so far
    written: dict = field(default_factory=dict)  # relative name -> size, sha256 as written
    write_s: float = 0.0  # the slowest rank's seconds until its data files were on disk


class CheckpointManager:
    """Writes, finds, verifies and prunes the step_N checkpoints of one output folder. With
    `background` a save returns once every rank holds a host copy of its state; the files are
    written while training goes on and step_N appears when they are all on disk (`poll`,
    `wait`)."""

    def __init__(self, output_dir: str | Path, *, max_keep: int = 0, full_hash: bool = False,
                 background: bool = False, report: Callable[[str], None] | None = None):
        self.root = Path(output_dir) / "checkpoints"
        self.max_keep = max_keep
        self.full_hash = full_hash  # verify every byte's sha256, not sizes and quick digests
        self.background = background
        # One line per published save, its write and blocked seconds (default: stderr).
        self.report = report or _to_stderr
        self._pending: _Pending | None = None
        self._metrics: dict[str, float] = {}

    def step_folders(self) -> list[tuple[int, Path]]:
        """(step, folder) of every step_N folder, sound or not, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.root.iterdir()
                      if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir())

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, folder) of every checkpoint with a manifest and a state file, oldest first
        (not hashed: see `newest_sound` for the verified choice)."""
        return [(s, p) for s, p in self.step_folders()
                if (p / MANIFEST).is_file() and (p / STATE_FILE).is_file()]

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    def newest_sound(self) -> tuple[Path | None, list[str]]:
        """The newest checkpoint that verifies (None if none) and a line per newer one skipped."""
        skipped = []
        for _, folder in reversed(self.step_folders()):
            problem = verify_checkpoint(folder, full_hash=self.full_hash)
            if problem is None:
                return folder, skipped
            skipped.append(f"checkpoint {folder.name} is damaged: {problem}; skipped")
        return None, skipped

    def resolve(self, resume: str, *, report: Callable[[str], None] | None = None) -> Path | None:
        """trainer.resume: auto = the newest checkpoint that verifies (None if there is no
        step_N folder at all), never = None, or a checkpoint folder, which must verify.
        Each damaged checkpoint that auto skips is described to `report` (default: stderr)."""
        if resume == "never":
            return None
        if resume == "auto":
            folder, skipped = self.newest_sound()
            for line in skipped:
                (report or _to_stderr)(line)
            if folder is None and skipped:
                raise RLHFError(f"no checkpoint in {self.root} verifies ({skipped[0]}); start "
                                "afresh with trainer.resume=never trainer.overwrite=true (moves "
                                "them aside) or use another trainer.output_dir")
            return folder
        folder = Path(resume)
        if not folder.is_dir() or not _STEP_DIR.fullmatch(folder.name):
            raise RLHFError(f"trainer.resume={resume!r} is not a checkpoint folder; give an "
                            "OUTPUT_DIR/checkpoints/step_N folder, auto or never")
        problem = verify_checkpoint(folder, full_hash=self.full_hash)
        if problem is not None:
            good, _ = CheckpointManager(folder.parent.parent,
                                        full_hash=self.full_hash).newest_sound()
            fix = (f"resume from {good.name} with trainer.resume={good}" if good is not None
                   else "start afresh with trainer.resume=never")
            raise RLHFError(f"checkpoint {folder.name} is damaged: {problem}; {fix}")
        return folder

    def save(self, step: int, *, state: dict, roles: Mapping[str, Any] | None = None,
             write_roles: Callable[[Path], None] | None = None) -> Path:
        """Checkpoint step_N: each of `roles` (a worker group's view of
        workers.checkpoint.CheckpointMixin: `save_checkpoint`, `checkpoint_written`,
        `finish_checkpoint`, each answering per rank) writes its engine files into the folder
        of its name, `write_roles(folder)` (if given) any other files; then `state` (the
        driver's) and the manifest are written, and the folder is published as step_N.
        `state["config"]` (the job's config as a dict) goes into the manifest. A pending
        background save is published first (its error raised). With `background`, returns
        step_N's path before it exists: `poll` publishes it once written, `wait` waits for
        that."""
        self.wait()
        began = time.monotonic()
        final = self.root / f"step_{step}"
        stack = ExitStack()
        # A folder saved again (a resumed run's final save) is swapped whole, like a new one.
        tmp = stack.enter_context(atomic_folder(final))
        roles = dict(roles or {})
        background = self.background and bool(roles)
        try:
            if write_roles is not None:
                write_roles(tmp)
            written: dict[str, dict] = {}
            write_s = 0.0
            for role, view in roles.items():
                write_s = max(write_s, _take_files(
                    written, role, view.save_checkpoint(str(tmp / role), background)))
            buffer = io.BytesIO()
            torch.save(state, buffer)  # now: the state's objects may change once training goes on
        except BaseException:
            stack.__exit__(*sys.exc_info())  # removes the temporary folder
            raise
        self._pending = _Pending(step, stack, tmp, roles, buffer.getvalue(),
                                 state.get("config", {}), began, time.monotonic() - began,
                                 written, write_s)
        if not background:
            self.wait()
        return final

    def poll(self) -> dict[str, float]:
        """Publish a background save whose files are all written (asks each rank, no wait);
        return the metrics of the last published save not yet returned ({} if none):
        checkpoint/blocked_s, the seconds the training loop spent in it, and
        checkpoint/write_s, from its start until its files were on disk."""
        pending = self._pending
        if pending is not None and all(all(view.checkpoint_written())
                                       for view in pending.roles.values()):
            self.wait()
        metrics, self._metrics = self._metrics, {}
        return metrics

    def wait(self) -> Path | None:
        """Wait for a pending save's files and publish it (the atomic rename last); return its
        folder, None when nothing was pending. A failed write raises RLHFError and leaves the
        previous checkpoints as they were."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        waited = time.monotonic()
        final = self.root / f"step_{pending.step}"
        try:
            if self.background:
                for role, view in pending.roles.items():
                    pending.write_s = max(pending.write_s, _take_files(
                        pending.written, role, view.finish_checkpoint()))
            written = time.monotonic()  # every rank's files are on disk
            with atomic_write(pending.tmp / STATE_FILE, "wb") as f:
                f.write(pending.state)
            pending.written[STATE_FILE] = {"size": len(pending.state),
                                           "sha256": hashlib.sha256(pending.state).hexdigest()}
            write_manifest(pending.tmp, step=pending.step, config=pending.config,
                           known=pending.written)  # last, see above
        except BaseException as e:
            pending.stack.__exit__(*sys.exc_info())  # removes the temporary folder
            if isinstance(e, Exception):
                raise RLHFError(f"checkpoint step_{pending.step} could not be written ({e}); "
                                "the previous checkpoints are as they were") from e
            raise
        pending.stack.close()  # the rename that publishes step_N
        self._prune()
        done = time.monotonic()
        blocked = pending.blocked_s + done - waited
        # The slowest rank's write, then what the driver did to publish it (a wait for the
        # write is in the former).
        write_s = max(pending.write_s, pending.blocked_s) + done - written
        self._metrics = {"checkpoint/blocked_s": blocked, "checkpoint/write_s": write_s}
        mode = "in the background" if self.background and pending.roles else "in the foreground"
        self.report(f"checkpoint {final.name} written {mode} in {write_s:.2f} s; training was "
                    f"blocked {blocked:.2f} s")
        return final

    def settle(self, error: BaseException) -> None:
        """On a run stopped by `error`: publish a pending background save unless a worker
        failed (its ranks may be stuck in a collective: the save stays unpublished, the
        previous checkpoint the newest); never raises, says what happened."""
        if self._pending is None:
            return
        # Here, not at the top: the controller package imports Ray, which the driver's checks
        # (rlhf.trainer.run_folder) do without.
        from rlhf.controller.errors import WorkerError

        if isinstance(error, WorkerError):
            self.report(f"checkpoint step_{self._pending.step} was not completed (a worker "
                        "failed); the previous checkpoint stays the newest")
            self._pending = None
            return
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - the run's own error is the one raised
            self.report(str(e))

    def load_state(self, folder: Path) -> dict:
        """The driver state of a checkpoint (our own file: numpy and Python RNG states)."""
        try:
            return torch.load(folder / STATE_FILE, weights_only=False)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
            raise RLHFError(f"checkpoint {folder.name} is damaged: {STATE_FILE} cannot be read "
                            f"({type(e).__name__}: {e})") from None

    def remove_stale(self) -> None:
        """Delete temporary folders left by a crash during a save; a step_N that a crash
        caught between the two renames of its re-save (rlhf.files.atomic_folder) gets its
        previous folder back."""
        if not self.root.is_dir():
            return
        for path in self.root.glob(".step_*.old-*"):
            final = self.root / path.name[1:].split(".old-")[0]
            if not final.exists():
                path.rename(final)
        for path in self.root.glob(".step_*"):
            shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        if self.max_keep > 0:
            for _, path in self.step_folders()[:-self.max_keep]:
                shutil.rmtree(path, ignore_errors=True)
