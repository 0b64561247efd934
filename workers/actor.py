"""ActorWorker: the policy's TrainEngine; scores rollouts and takes PPO steps.

Fields in and out are listed in rlhf/data/fields.py. The loss of one micro-batch is

    policy loss(log_probs, old_log_probs, advantages)          (algorithm.policy_loss: ppo
                                                                 with dual clip, gspo, cispo)
    + kl_loss_coef * kl_loss(log_probs, ref_log_probs)           when algorithm.use_kl_loss
    - entropy_coeff * entropy_bonus(entropy)

each aggregated by algorithm.loss_agg_mode and normalised by the mini-batch's global token /
sequence counts (over every DP rank), so the micro-batch losses add up to the mini-batch loss.

On-policy (one PPO epoch of one mini-batch) the driver may skip compute_log_prob and send a
batch without `old_log_probs` (rlhf.trainer.step_splits.fuse_old_log_probs decides): the first
forward of the update then gives them (detached, so the ratio is exactly 1 there, as it is
with a separate pass) and update_actor returns them with `entropy`.
"""

from __future__ import annotations

from torch import Tensor

from rlhf.algorithms import (
    aggregate,
    entropy_bonus,
    get_policy_loss,
    kl_loss,
    policy_clip,
    truncated_is_weights,
)
from rlhf.config import JobConfig, ref_from_actor
from rlhf.controller import Dispatch, WorkerContext, register
from rlhf.data.batch import Batch
from rlhf.data.batch_split import GroupBatches
from rlhf.data.fields import MASK, SEQ_IS_WEIGHTS, TOKENS, require_fields
from rlhf.data.routes import ROUTES
from rlhf.engine.offload import Offloader, in_phase
from rlhf.errors import ConfigError
from rlhf.models.lora import disable_adapters, is_lora_param
from rlhf.rollout import RolloutReplica, sampling_temperature
from rlhf.rollout.routing import check_replay_model, replays_routes
from workers.base import MemoryReportMixin, Worker, build_engine
from workers.checkpoint import CheckpointMixin
from workers.micro_batches import forward_micro_batches, response_fields, routes_field
from workers.reference import ref_log_probs
from workers.rollout import WeightSenderMixin, rollout_spec, sample_rollouts
from workers.updates import ppo_updates, token_share


class ActorWorker(CheckpointMixin, WeightSenderMixin, MemoryReportMixin, Worker):
    """The policy on its own (config.actor.parallel) layout: rollouts with the rank's vLLM
    replica (built on the first generate or sync; none when rollout.placement is separate,
    where WeightSenderMixin sends the weights to the rollout ranks), log-probs, PPO updates."""

    def __init__(self, ctx: WorkerContext, *, config: JobConfig):
        super().__init__(ctx)
        self.config = config
        self.lora = config.actor.lora
        self.engine = build_engine(self, config, "actor", path=config.model.path, head="lm",
                                   train=True)
        self.offload = Offloader(self.engine.state_tensors, config=config.actor.offload)
        check_replay_model(config.rollout, is_moe=self.engine.model.args.is_moe)
        self.rollout = (RolloutReplica(rollout_spec(ctx, config))
                        if config.rollout.placement == "colocated" else None)

    @register(dispatch=Dispatch.RANK_SPLIT)
    @in_phase("generate")
    def generate(self, batch: Batch, *, greedy: bool = False) -> Batch:
        """rollout.n samples of every `prompt_ids` row (prompt-major; greedy: one, at
        temperature 0): `response_ids`, `rollout_log_probs` and meta["metrics"]; with
        rollout.env, multi-turn episodes with `model_mask` and `env_reward` too.

        Every rank samples its own chunk. Sample j of the prompt in row p of the driver's batch
        is seeded by (batch.meta["seed"], p, j) when the driver gives that int (reproducible
        across layouts and resumes), else by (rollout.seed, number of earlier calls, p, j).
        """
        return sample_rollouts(self._replica(), batch, greedy=greedy, where="actor.generate",
                               env=self.config.rollout.env.path is not None)

    @register(dispatch=Dispatch.COLLECTIVE)
    @in_phase("sync")
    def sync_weights(self) -> dict[str, float]:
        """Push the policy into this rank's vLLM replica if it changed since the last sync;
        sync/bytes (per replica; with LoRA the adapter's), sync/full_bytes (what a full-weight
        sync sends), sync/seconds (split into sync/gather_s, sync/broadcast_s, sync/reload_s),
        sync/gb_per_s, sync/skipped."""
        metrics = self._replica().sync(self.export_weights)
        metrics["sync/full_bytes"] = 0.0 if metrics["sync/skipped"] else self.full_sync_bytes()
        return metrics

    def export_weights(self):
        """What a sync sends, as full tensors in rollout.sync_bucket_mb buckets (collective):
        the policy's HF tensors, or with actor.lora only the adapter's factors."""
        bucket_bytes = int(self.config.rollout.sync_bucket_mb * 2**20)  # one bucket alive at a time
        select = is_lora_param if self.lora is not None and self.lora.enabled else None
        return self.engine.export_hf_weights(bucket_bytes=bucket_bytes, select=select)

    _full_sync_bytes: float | None = None  # the policy's size never changes: counted once

    def full_sync_bytes(self) -> float:
        """Bytes of a full-weight sync of this policy (with LoRA: the base weights, which an
        adapter sync leaves out); collective over pp the first time."""
        if self._full_sync_bytes is None:
            self._full_sync_bytes = float(self.engine.export_nbytes(
                select=lambda name: not is_lora_param(name)))
        return self._full_sync_bytes

    def _replica(self) -> RolloutReplica:
        if self.rollout is None:
            raise RuntimeError("rollout.placement is separate: this actor hosts no vLLM replica; "
                               "the driver samples on the rollout role and calls send_weights")
        return self.rollout

    def _after_load(self) -> None:
        if self.rollout is not None:
            self.rollout.mark_stale()

    @register(dispatch=Dispatch.DP_COMPUTE)
    @in_phase("forward")
    def compute_log_prob(self, batch: Batch, split: GroupBatches | None = None) -> Batch:
        """`old_log_probs` and `entropy` of every response token at the sampling temperature.
        With rollout.routing_replay on, an MoE policy replays the batch's `routed_experts`, or
        without them routes freely and returns the routes it chose (rlhf.rollout.routing)."""
        require_fields(batch, TOKENS, "actor.compute_log_prob")
        replay = replays_routes(self.config.rollout)
        record = replay and ROUTES not in batch  # with routing replay on, routes in or out
        mbs = forward_micro_batches(batch, self.config.actor, split, key="actor",
                                    replay_routes=replay)
        outputs = self.engine.forward(mbs, outputs=("log_probs", "entropy", ROUTES) if record
                                      else ("log_probs", "entropy"),
                                      temperature=sampling_temperature(self.config.rollout))
        fields = response_fields(outputs, mbs, {"old_log_probs": "log_probs", "entropy": "entropy"})
        return fields.union(routes_field(outputs, mbs, batch)) if record else fields

    @register(dispatch=Dispatch.DP_COMPUTE)
    @in_phase("forward")
    def compute_ref_log_prob(self, batch: Batch, split: GroupBatches | None = None) -> Batch:
        """`ref_log_probs` from this model's frozen base, adapters disabled: the reference policy
        when actor.lora is on (`rlhf.config.ref_from_actor`; no reference role is built)."""
        if not ref_from_actor(self.config):
            raise ConfigError("actor.compute_ref_log_prob needs actor.lora on (its base is then "
                              "the reference) and a KL term; otherwise the ref role computes them")
        with disable_adapters(self.engine.model):
            return ref_log_probs(self.engine, batch, split, self.config, key="actor")

    @register(dispatch=Dispatch.DP_COMPUTE_METRICS)
    @in_phase("update")
    def update_actor(self, batch: Batch,
                     split: GroupBatches | None = None) -> dict[str, float] | tuple[dict, Batch]:
        """algorithm.ppo_epochs passes over the batch, one optimizer step per mini-batch of
        actor.ppo_mini_batch_size prompts (times rollout.n samples), in order. Without
        `old_log_probs` in the batch (on-policy only): (metrics, Batch of the `old_log_probs`
        and `entropy` its first forward gave). At ep > 1, actor/all_to_all_s: this rank's
        seconds in expert all-to-alls since the last update (the forwards between included)."""
        fused = "old_log_probs" not in batch
        per_token = self._per_token_fields(fused)
        require_fields(batch, (*TOKENS, *per_token), "actor.update_actor")
        seen: list | None = [] if fused else None
        metrics = ppo_updates(self.engine, batch, split, self.config, "actor", per_token,
                              lambda tokens, seqs: self._loss_fn(tokens, seqs, seen=seen),
                              outputs=("log_probs", "entropy"), on_policy=fused,
                              temperature=sampling_temperature(self.config.rollout),
                              replay_routes=replays_routes(self.config.rollout))
        if self.rollout is not None:
            self.rollout.mark_stale()
        if self.engine.mesh.ep_size > 1:  # this update's and the forwards' since the last one
            metrics["actor/all_to_all_s"] = self.engine.take_all_to_all_s()
        if not fused:
            return metrics
        outputs = [{"log_probs": lp, "entropy": ent} for lp, ent, _ in seen]
        fields = response_fields(outputs, [mb for _, _, mb in seen],
                                 {"old_log_probs": "log_probs", "entropy": "entropy"})
        return metrics, fields

    def _per_token_fields(self, fused: bool) -> tuple[str, ...]:
        fields = ["advantages"] if fused else ["old_log_probs", "advantages"]
        if self.config.algorithm.use_kl_loss:
            fields.append("ref_log_probs")
        if self.config.rollout.tis_cap is not None:
            fields.append("rollout_log_probs")
        if self.config.rollout.seq_tis_cap is not None:
            fields.append(SEQ_IS_WEIGHTS)
        return tuple(fields)

    def _loss_fn(self, global_tokens: int, global_seqs: int, *, seen: list | None = None):
        """The PPO loss; with `seen` (fused old log-probs), the detached current log-probs
        stand in for `old_log_probs`, and each micro-batch's (log-probs, entropy, mb) is kept."""
        algo, tis_cap = self.config.algorithm, self.config.rollout.tis_cap
        policy_loss = get_policy_loss(algo.policy_loss)
        norm = dict(agg_mode=algo.loss_agg_mode, global_tokens=global_tokens,
                    global_seqs=global_seqs, max_response_length=self.config.rollout.max_response_tokens)

        def loss_fn(out: dict[str, Tensor], mb) -> tuple[Tensor, dict]:
            t, cu = mb.tensors, mb.packed.cu_seqlens
            mask_T = t[MASK].bool()
            if seen is None:
                old_T = t["old_log_probs"]
            else:
                old_T = out["log_probs"].detach()
                seen.append((old_T, out["entropy"].detach(), mb))
            is_weights_T = None
            if tis_cap is not None:
                is_weights_T = truncated_is_weights(old_T, t["rollout_log_probs"], tis_cap)
            if SEQ_IS_WEIGHTS in t:  # the driver's sequence-level weights, one per token
                seq_T = t[SEQ_IS_WEIGHTS]
                is_weights_T = seq_T if is_weights_T is None else is_weights_T * seq_T
            clip_low, clip_high = policy_clip(algo)
            pg, pg_metrics = policy_loss(
                out["log_probs"], old_T, t["advantages"], mask_T, cu, clip_low=clip_low,
                clip_high=clip_high, clip_c=algo.clip_ratio_c, is_weights_T=is_weights_T, **norm)
            loss = pg
            if algo.entropy_coeff:  # at 0 the entropy is a metric: no backward through it
                loss = loss - algo.entropy_coeff * entropy_bonus(out["entropy"], mask_T, cu,
                                                                 **norm)
            share = token_share(mask_T, global_tokens)
            metrics = {
                "pg_loss": pg.detach(),
                "clipfrac": pg_metrics["clipfrac"] * share,
                "approx_kl": pg_metrics["approx_kl"] * share,
                "entropy": aggregate(out["entropy"].detach(), mask_T, cu, "token-mean",
                                     global_tokens=global_tokens),
            }
            if algo.use_kl_loss:
                kl = kl_loss(out["log_probs"], t["ref_log_probs"], mask_T, cu,
                             kind=algo.kl_loss_type, **norm)
                loss = loss + algo.kl_loss_coef * kl
                metrics["kl_loss"] = kl.detach()
            return loss, metrics

        return loss_fn

