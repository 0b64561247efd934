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

from rlhf.config import JobConfig
from rlhf.controller import Dispatch, WorkerContext, register
from rlhf.data.batch import Batch
from rlhf.data.fields import require_fields
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
        require_fields(batch, ("input_ids", "max_tokens", "seed"), "rollout.generate_segments")
        return self.replica.continue_samples(batch["input_ids"],
                                             max_tokens=batch["max_tokens"].tolist(),
                                             seeds=batch["seed"].tolist())

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
