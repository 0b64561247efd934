"""Checkpoint and export methods shared by the roles that own a training TrainEngine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch.distributed as dist

from rlhf.config.schema import LoraConfig
from rlhf.controller import Dispatch, register
from rlhf.controller.nodes import node_label
from rlhf.engine.checkpoint import EngineWrite
from rlhf.engine.offload import in_phase
from rlhf.errors import RLHFError
from rlhf.files import read_marker
from rlhf.models.hf_io import hf_config, write_hf_folder
from rlhf.models.lora import is_lora_param
from rlhf.models.peft_folder import merged_stream, write_adapter_folder

if TYPE_CHECKING:
    from rlhf.engine import TrainEngine

EXPORT_BUCKET_BYTES = 256 * 2**20  # also the size of each safetensors file written


class CheckpointMixin:
    """`save_checkpoint` / `load_checkpoint` of `self.engine` under one folder per role, and
    `export_hf` of its weights as a Hugging Face folder (any tp/pp layout). Needs
    `self.offload` (rlhf.engine.offload.Offloader), which brings the state they read back,
    and `self.lora`, the role's LoRA settings (None or r = 0: no adapters)."""

    engine: TrainEngine
    lora: LoraConfig | None = None
    _checkpoint_write: EngineWrite | None = None  # a background save's pending write

    @register(dispatch=Dispatch.ONE_TO_ALL)
    @in_phase("checkpoint")
    def save_checkpoint(self, folder: str, background: bool = False) -> dict[str, Any] | None:
        """Write this rank's engine shard under `folder` (collective); returns what
        `EngineWrite.finish` does (its files' sizes and sha256, hashed as written). With
        `background` only the plan and a host copy are made now: the write goes on in a
        thread, `checkpoint_written` tells when it is done, `finish_checkpoint` completes it."""
        if self._checkpoint_write is not None:
            raise RLHFError(f"a checkpoint write into {self._checkpoint_write.folder} is still "
                            "pending: finish_checkpoint before the next save")
        write = self.engine.start_checkpoint(Path(folder), background=background)
        if background:
            self._checkpoint_write = write
            return None
        return write.finish()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def checkpoint_written(self) -> bool:
        """Whether this rank's background checkpoint write (if any) has finished writing."""
        return self._checkpoint_write is None or self._checkpoint_write.done()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def finish_checkpoint(self) -> dict[str, Any] | None:
        """Wait for the background write `save_checkpoint` started and complete it
        (collective: the metadata); None when none is pending."""
        write, self._checkpoint_write = self._checkpoint_write, None
        return None if write is None else write.finish()

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
    def export_hf(self, folder: str, config_source: str, adapter: bool = False) -> str:
        """Write the full weights as a Hugging Face folder (by the mesh's first rank; every rank
        takes part in the gathers), with config.json and tokenizer files of `config_source`.
        A LoRA policy (`self.lora`) is written with its adapters merged into the base, or with
        `adapter` as a peft adapter folder of the base `config_source`."""
        engine, mesh = self.engine, self.engine.mesh
        lora = self.lora if self.lora is not None and self.lora.enabled else None
        if adapter and lora is None:
            raise ValueError("this policy has no LoRA adapters (actor.lora.r = 0): export the "
                             "full weights instead of an adapter folder")
        select = is_lora_param if adapter else None
        buckets = engine.export_hf_weights(bucket_bytes=EXPORT_BUCKET_BYTES, select=select)
        if mesh.rank == mesh.ranks[0]:
            if adapter:
                assert lora is not None  # refused above
                write_adapter_folder(folder, (t for bucket in buckets for t in bucket),
                                     lora=lora, base_model=config_source)
            else:
                if lora is not None:
                    buckets = merged_stream(buckets, lora=lora)
                write_hf_folder(folder, buckets, config_source=config_source,
                                config=hf_config(engine.model, config_source))
        else:
            for _ in buckets:  # the TP gathers and PP broadcasts are collective
                pass
        dist.barrier(group=mesh.dp_group)
        dist.barrier(group=mesh.mp_group)
        return str(folder)
