"""Exact per-rank parameter shapes, from the project's own build path on the meta device.

A pipeline rank's shard is what `rlhf.models.build.build_model` would build: the model
class on meta, cut to the rank's stage chunks (`rank_chunks`), cast, then `apply_tp` and
`apply_ep` (E / ep experts per MoE layer). Nothing
is allocated and no weights are read. `apply_tp` needs a TP process group of the real size, so
the build runs inside a "fake" torch.distributed world of tp * pp * ep ranks (torch's FakeProcessGroup:
groups of the right size that never communicate), the device-free method torchtitan's memory
estimator uses. When this process already has a torch.distributed world (a worker, a test
fixture), the build runs in a spawned subprocess instead, so that world is left untouched.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.config.schema import LoraConfig, ParallelConfig
from rlhf.models.config import ModelArgs
from rlhf.models.expert_sharding import apply_ep
from rlhf.models.lora import apply_lora
from rlhf.models.param_table import param_table
from rlhf.models.tp_sharding import TPState, apply_tp
from rlhf.models.transformer import CausalLM, ValueModel
from rlhf.parallel.layout import Layout
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.parallel.stages import rank_chunks


@dataclass(frozen=True)
class ParamShape:
    """One parameter of a rank's shard, once even when tied: name, local shape, dtype, and
    whether it trains (the optimizer and the fp32 masters hold exactly these)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool = True
    expert: bool = False
    """A routed expert's parameter (a rank holds E / ep experts of each MoE layer)."""

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@functools.lru_cache(maxsize=256)  # pure in its (frozen) arguments; advice re-plans often
def stage_shapes(args: ModelArgs, parallel: ParallelConfig, *, head: str,
                 dtype: torch.dtype, lora: LoraConfig | None = None
                 ) -> tuple[tuple[ParamShape, ...], ...]:
    """Per pipeline rank (index = pp_rank), the parameters one of its TP ranks holds; with
    `lora` (enabled) the adapters too, and only they are trainable.

    TP ranks of one stage hold the same shapes (the vocabulary is padded to a tp multiple),
    and every DP replica is the same, so pp lists describe the whole role.
    """
    if dist.is_initialized():
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            return pool.submit(_stage_shapes, args, parallel, head, dtype, lora).result()
    return _stage_shapes(args, parallel, head, dtype, lora)


def _stage_shapes(args: ModelArgs, parallel: ParallelConfig, head: str, dtype: torch.dtype,
                  lora: LoraConfig | None) -> tuple[tuple[ParamShape, ...], ...]:
    return tuple(_rank_shapes(args, parallel, head=head, dtype=dtype, pp_rank=pp_rank,
                              lora=lora)
                 for pp_rank in range(parallel.pp))


def _rank_shapes(args: ModelArgs, parallel: ParallelConfig, *, head: str, dtype: torch.dtype,
                 pp_rank: int, lora: LoraConfig | None) -> tuple[ParamShape, ...]:
    model_cls = {"lm": CausalLM, "value": ValueModel}[head]
    stage = {}
    if parallel.pp > 1:  # the same cut as build_model
        chunks = rank_chunks(args.num_layers, pp=parallel.pp, vpp=parallel.vpp, pp_rank=pp_rank,
                             layers_per_stage=parallel.layers_per_stage)
        stage = dict(layer_ranges=[c.layer_range for c in chunks],
                     has_embedding=chunks[0].has_embedding, has_head=chunks[-1].has_head)
    # ep dp ranks: one ep group, whose ranks all hold E / ep experts
    layout = Layout.over(parallel.tp * parallel.pp * parallel.ep, tp=parallel.tp, pp=parallel.pp,
                         ep=parallel.ep)
    with _fake_world(world_size=layout.world_size, rank=layout.rank_at(dp=0, pp=pp_rank, tp=0)):
        mesh = ParallelMesh(range(layout.world_size), tp=parallel.tp, pp=parallel.pp,
                            ep=parallel.ep, cache=ProcessGroupCache())
        with torch.device("meta"):
            model = model_cls(args, **stage)
        model.to(dtype=dtype)
        apply_tp(model, mesh, sequence_parallel=parallel.sequence_parallel)
        if lora is not None and lora.enabled:  # the same adapters as build_model
            apply_lora(model, lora)
        apply_ep(model, mesh)
        experts = {e.name for e in param_table(model, tp=TPState()) if e.expert is not None}
        return tuple(ParamShape(name, tuple(p.shape), p.dtype, p.requires_grad, name in experts)
                     for name, p in model.named_parameters())  # named_parameters: tied once


@contextlib.contextmanager
def _fake_world(*, world_size: int, rank: int):
    """A torch.distributed world whose groups have real sizes and ranks but never communicate."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
