"""Rollout replicas on ranks of their own (rollout.placement separate), the actor's side of the
weight transfer that feeds them, and the sampling call both the actor (colocated) and the
rollout ranks run (`sample_rollouts`).

RolloutWorker hosts vLLM engines (rlhf.rollout.RolloutReplica, the same replica code the actor
uses when colocated) and no training engine. Its weights arrive over the transfer group
(rlhf.rollout.transfer): the driver calls `actor.send_weights()` and
`rollout.receive_weights()` at the same time. The group is made once, at start, by
`connect_weight_transfer` (rlhf.trainer.rollout_source).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from rlhf.config import JobConfig
from rlhf.controller import Dispatch, WorkerContext, register
from rlhf.data.batch import Batch
from rlhf.data.fields import require_fields
from rlhf.data.ragged import Ragged
from rlhf.engine.engine import resolve_dtype
from rlhf.engine.offload import in_phase
from rlhf.errors import ConfigError
from rlhf.parallel.layout import Layout
from rlhf.rollout import ReplicaSpec, RolloutReplica
from rlhf.rollout.multiturn import env_rows
from rlhf.rollout.transfer import SENDER, TransferAddress, TransferGroup
from workers.base import Worker

TRANSFER_TIMEOUT_S = 1800.0  # a broadcast waits at most this long for the other side


def transfer_backend(ctx: WorkerContext) -> str:
    return "nccl" if ctx.device.type == "cuda" else "gloo"


class RolloutWorker(Worker):
    """rollout.world_size ranks of vLLM replicas (rollout.tp consecutive ranks form one)."""

    def __init__(self, ctx: WorkerContext, *, config: JobConfig):
        super().__init__(ctx)
        self.config = config
        self.replica = RolloutReplica(rollout_spec(ctx, config))
        self.transfer: TransferGroup | None = None

    @register(dispatch=Dispatch.RANK_SPLIT)
    def generate(self, batch: Batch, *, greedy: bool = False) -> Batch:
        """As ActorWorker.generate, on the rollout ranks."""
        return sample_rollouts(self.replica, batch, greedy=greedy, where="rollout.generate",
                               env=self.config.rollout.env.path is not None)

    @register(dispatch=Dispatch.RANK_SPLIT)
    def generate_segments(self, batch: Batch) -> Batch:
        """One segment of streaming rollouts (trainer.async_mode streaming): each `input_ids`
        row (prompt + tokens so far) continues by at most its `max_tokens` new tokens with its
        `seed`; see RolloutReplica.continue_samples."""
        require_fields(batch, ("input_ids", "prompt_len", "max_tokens", "seed"),
                       "rollout.generate_segments")
        out = self.replica.continue_samples(batch["input_ids"],
                                            max_tokens=batch["max_tokens"].tolist(),
                                            seeds=batch["seed"].tolist())
        stops = self.config.rollout.stop
        if not stops:
            return out
        tokenizer = self.replica.ensure_sampler().llm.get_tokenizer()
        return cut_at_stops(out, batch["input_ids"], batch["prompt_len"].tolist(), stops=stops,
                            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def holds_weights(self) -> bool:
        """Whether this rank's engine still holds the weights it was last sent (the driver
        asks before skipping a sync); one answer per rank."""
        return self.replica.holds_weights()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def join_weight_transfer(self, address: TransferAddress) -> None:
        """Join the transfer group as transfer rank 1 + rank (with the actor's rank 0)."""
        self.transfer = TransferGroup.join(address, rank=1 + self.ctx.rank,
                                           device=self.ctx.device, timeout_s=TRANSFER_TIMEOUT_S)

    @register(dispatch=Dispatch.COLLECTIVE)
    def receive_weights(self) -> dict[str, float]:
        """Load the policy the actor sends into this rank's engine, through the colocated
        sync's reload path; sync/* metrics (per replica, slowest rank)."""
        if self.transfer is None:
            raise RuntimeError("receive_weights before join_weight_transfer")
        self.replica.mark_stale()
        return self.replica.sync(self.transfer.receive)


class WeightSenderMixin:
    """The actor's side of the transfer: every rank exports, rank 0 broadcasts (needs `ctx`,
    `export_weights()`, `full_sync_bytes()` and the `offload` phases of ActorWorker)."""

    _transfer: TransferGroup | None = None
    _transfer_store = None
    if TYPE_CHECKING:  # what the class mixing this in provides
        ctx: WorkerContext

        def export_weights(self) -> Iterable[list[tuple[str, Tensor]]]: ...

        def full_sync_bytes(self) -> float: ...

    @register(dispatch=Dispatch.RANK_ZERO)
    def open_weight_transfer(self, rollout_ranks: int) -> TransferAddress:
        """Host the transfer group's store on rank 0; returns where the rollout ranks meet."""
        import ray

        self._transfer_store, port = TransferGroup.host_store(TRANSFER_TIMEOUT_S)
        return TransferAddress(host=ray.util.get_node_ip_address(), port=port,
                               world_size=1 + rollout_ranks, backend=transfer_backend(self.ctx))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def join_weight_transfer(self, address: TransferAddress) -> None:
        """Rank 0 joins as the sender (collective with the rollout ranks' join)."""
        if self.ctx.rank == 0:
            self._transfer = TransferGroup.join(address, rank=SENDER, device=self.ctx.device,
                                                timeout_s=TRANSFER_TIMEOUT_S,
                                                store=self._transfer_store)

    @register(dispatch=Dispatch.COLLECTIVE)
    @in_phase("sync")
    def send_weights(self) -> dict[str, float]:
        """Export the policy (with LoRA, its adapter) on every rank; rank 0 broadcasts it to the
        rollout ranks. Returns rank 0's transfer/bytes, transfer/seconds (export included)
        and sync/full_bytes (what a full-weight sync sends)."""
        start = time.perf_counter()
        buckets = self.export_weights()
        full_bytes = self.full_sync_bytes()  # collective over pp the first time
        if self.ctx.rank != 0:
            for _ in buckets:  # the export is collective over the actor's TP/PP groups
                pass
            return {}
        if self._transfer is None:
            raise RuntimeError("send_weights before join_weight_transfer")
        sent = self._transfer.send(buckets)
        return {"transfer/bytes": sent["bytes"], "transfer/seconds": time.perf_counter() - start,
                "sync/full_bytes": full_bytes}


# The rollout fields a call may replace through batch.meta["sampling"].
SAMPLING_OVERRIDES = {"n", "temperature", "top_p", "top_k"}


def sample_rollouts(replica, batch: Batch, *, greedy: bool, where: str, env: bool) -> Batch:
    """`replica.generate` on this rank's `prompt_ids` (the actor's colocated replica or a
    separate rollout rank's), after checking the driver's `batch.meta["seed"]`, with the
    sampling settings of `batch.meta["sampling"]` if any (sampled validation); with `env`
    (rollout.env set), multi-turn episodes started from the batch's dataset rows."""
    require_fields(batch, ("prompt_ids",), where)
    seed = batch.meta.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"batch.meta['seed'] must be an int, got {seed!r}")
    sampling = batch.meta.get("sampling")
    if sampling is not None and not set(sampling) <= SAMPLING_OVERRIDES:
        raise ValueError(f"batch.meta['sampling'] may set {sorted(SAMPLING_OVERRIDES)}, got "
                         f"{sorted(sampling)}")
    rows = env_rows(batch) if env else None
    return replica.generate(batch["prompt_ids"], greedy=greedy, seed=seed, env_rows=rows,
                            sampling=sampling)


def stop_cut(decode: Callable[[list[int]], str], earlier: list[int], new: list[int],
             stops: Sequence[str]) -> int | None:
    """How many of a segment's `new` tokens its response keeps when a stop string ends within
    them, `earlier` being the tokens its generation sampled before the segment (the response's;
    with an environment, the current model turn's): up to and including the token that
    completes the first stop string in their text, where vLLM cuts an unsegmented generation;
    None when no stop string ends within `new`.

    vLLM looks only at the segment's own text, so a stop string split across two segments
    needs the earlier tail: as many tokens as the longest stop string has characters, and
    one more (a token decodes to one character or more), never the prompt's (vLLM does not
    match stop strings in the prompt either)."""
    if not stops or not new:
        return None
    tail = earlier[-(max(len(s) for s in stops) + 1):]
    tail_chars = len(decode(tail))

    def ends_in_new(k: int) -> bool:  # a stop string ends within new[:k]
        text = decode(tail + new[:k])
        return any(text.find(s, max(0, tail_chars - len(s) + 1)) >= 0 for s in stops)

    if not ends_in_new(len(new)):
        return None
    return next(k for k in range(1, len(new) + 1) if ends_in_new(k))


def cut_at_stops(out: Batch, inputs: Ragged, prompt_lens: list[int], *, stops: Sequence[str],
                 decode: Callable[[list[int]], str]) -> Batch:
    """A segment's sampled rows (`response_ids`, `rollout_log_probs`, `stopped`) cut by
    `stop_cut`: a row whose text, with its response's earlier tail, completes a stop string
    keeps the tokens up to it and is stopped."""
    ids = [row.tolist() for row in out["response_ids"].to_list()]
    log_probs = [row.tolist() for row in out["rollout_log_probs"].to_list()]
    stopped = out["stopped"].clone()
    for i, (row, start) in enumerate(zip(inputs.to_list(), prompt_lens, strict=True)):
        keep = stop_cut(decode, row.tolist()[start:], ids[i], stops)
        if keep is not None:
            ids[i], log_probs[i], stopped[i] = ids[i][:keep], log_probs[i][:keep], True
    _, rest = out.pop(["response_ids", "rollout_log_probs", "stopped"])
    return rest.union(Batch({
        "response_ids": Ragged.from_list(ids, dtype=out["response_ids"].values.dtype),
        "rollout_log_probs": Ragged.from_list(log_probs,
                                              dtype=out["rollout_log_probs"].values.dtype),
        "stopped": stopped}))


def rollout_spec(ctx: WorkerContext, config: JobConfig) -> ReplicaSpec:
    """This rank's rollout replica: rollout.tp consecutive ranks of the group hosting rollouts
    (the actor's, or the rollout pool's) form one (collective: every rank builds the same
    replica groups in the same order)."""
    tp, world = config.rollout.tp, ctx.world_size
    if world % tp:
        raise ConfigError(f"rollout.tp={tp} does not divide the {world} ranks hosting rollouts; "
                          f"pick a rollout.tp that divides {world}")
    replica_group = None
    for ranks in Layout.over(world, tp=tp).groups("mp") if tp > 1 else ():
        group = ctx.group_cache.get(ranks)
        if ctx.rank in ranks:
            replica_group = group
    return ReplicaSpec(
        model_path=config.model.path, config=config.rollout, device=ctx.device,
        dtype=resolve_dtype(config.actor.dtype, ctx.device),
        max_model_len=config.data.max_prompt_length + config.rollout.max_response_tokens,
        world_group=ctx.group_cache.get(range(world)), replica_group=replica_group,
        rank=ctx.rank, lora=config.actor.lora if config.actor.lora.enabled else None)
