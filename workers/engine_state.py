"""Checkpoint methods shared by the roles that own a training TrainEngine (actor, critic)."""

from __future__ import annotations

from pathlib import Path

from rlhf.controller import Dispatch, register


class CheckpointMixin:
    """`save_checkpoint` / `load_checkpoint` of `self.engine` under one folder per role."""

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
