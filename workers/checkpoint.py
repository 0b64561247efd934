"""Checkpoint and export methods shared by the roles that own a training TrainEngine."""

from __future__ import annotations

from pathlib import Path

import ray
import torch.distributed as dist

from rlhf.controller import Dispatch, register
from rlhf.controller.nodes import node_label
from rlhf.engine.offload import in_phase
from rlhf.files import read_marker
from rlhf.models.hf_io import hf_config, write_hf_folder

EXPORT_BUCKET_BYTES = 256 * 2**20  # also the size of each safetensors file written


class CheckpointMixin:
    """`save_checkpoint` / `load_checkpoint` of `self.engine` under one folder per role, and
    `export_hf` of its weights as a Hugging Face folder (any tp/pp layout). Needs
    `self.offload` (rlhf.engine.offload.Offloader), which brings the state they read back."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    @in_phase("checkpoint")
    def save_checkpoint(self, folder: str) -> str:
        """Write this rank's engine shard under `folder` (collective); returns the file."""
        return str(self.engine.save_checkpoint(Path(folder)))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    @in_phase("checkpoint")
    def load_checkpoint(self, folder: str) -> None:
        """Restore this rank's engine shard from `folder`, then run `_after_load`."""
        self.engine.load_checkpoint(Path(folder))
        self._after_load()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def read_marker(self, path: str) -> tuple[str, str | None]:
        """(node, text of `path`) as this rank sees it: rlhf.files.check_shared_folder."""
        return read_marker(path, node=node_label(ray.get_runtime_context().get_node_id()))

    def _after_load(self) -> None:
        """Hook for roles that cache something derived from the weights."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    @in_phase("sync")
    def export_hf(self, folder: str, config_source: str) -> str:
        """Write the full weights as a Hugging Face folder (by the mesh's first rank; every rank
        takes part in the gathers), with config.json and tokenizer files of `config_source`."""
        engine, mesh = self.engine, self.engine.mesh
        buckets = engine.export_hf_weights(bucket_bytes=EXPORT_BUCKET_BYTES)
        if mesh.rank == mesh.ranks[0]:
            write_hf_folder(folder, buckets, config_source=config_source,
                            config=hf_config(engine.model, config_source))
        else:
            for _ in buckets:  # the TP gathers and PP broadcasts are collective
                pass
        dist.barrier(group=mesh.dp_group)
        dist.barrier(group=mesh.mp_group)
        return str(folder)
