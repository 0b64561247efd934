"""Checkpoints under OUTPUT_DIR/checkpoints/step_N, each complete or absent.

A checkpoint is assembled in a hidden temporary folder (engine shards of each role, then the
driver's trainer_state.pt) and renamed to step_N as a whole, so a crash while saving never
leaves a partial step_N and never touches the previous ones.
"""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from rlhf.errors import RLHFError
from rlhf.files import atomic_folder, atomic_write

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"step_(\d+)")


def rng_state() -> dict:
    """The driver's random generators."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


class CheckpointManager:
    """Writes, finds and prunes the step_N checkpoints of one output folder."""

    def __init__(self, output_dir: str | Path, *, max_keep: int = 0):
        self.root = Path(output_dir) / "checkpoints"
        self.max_keep = max_keep

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir()
                 if (m := _STEP_DIR.fullmatch(p.name)) and (p / STATE_FILE).is_file()]
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    def resolve(self, resume: str) -> Path | None:
        """trainer.resume: auto = the latest checkpoint (None if none), never = None, or a path."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        folder = Path(resume)
        if not (folder / STATE_FILE).is_file():
            raise RLHFError(f"trainer.resume={resume!r} is not a checkpoint folder (no "
                            f"{STATE_FILE} in it); give a checkpoints/step_N folder, auto or "
                            "never")
        return folder

    def save(self, step: int, *, write_roles: Callable[[Path], None], state: dict) -> Path:
        """Run `write_roles(tmp)` (engine shards), write `state`, then publish as step_N."""
        final = self.root / f"step_{step}"
        # A folder saved again (a resumed run's final save) is swapped whole, like a new one.
        with atomic_folder(final) as tmp:
            write_roles(tmp)
            with atomic_write(tmp / STATE_FILE, "wb") as f:
                torch.save(state, f)
        self._prune()
        return final

    def load_state(self, folder: Path) -> dict:
        """The driver state of a checkpoint (our own file: numpy and Python RNG states)."""
        return torch.load(folder / STATE_FILE, weights_only=False)

    def remove_stale(self) -> None:
        """Delete temporary folders left by a crash during a save."""
        if self.root.is_dir():
            for path in self.root.glob(".step_*"):
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        if self.max_keep > 0:
            for _, path in self.checkpoints()[:-self.max_keep]:
                shutil.rmtree(path, ignore_errors=True)
