"""The PPO/GRPO step and its loop: one controller drives the role worker groups step by step.

One step (see rlhf/data/fields.py for the fields each call reads and writes):
sync weights -> generate -> rewards (with DAPO's dynamic sampling, repeated on fresh prompts
until the batch is full) -> old log-probs -> ref log-probs -> values -> advantages (driver) ->
masks and weights of the per-response recipes -> critic update -> actor update; every phase
timed. Every role call gets the driver's batch split of its mini- and micro-batches (step_splits.py);
on-policy, the old log-probs come from the actor update's first forward instead of their own
pass. Validation (greedy, held-out prompts) every trainer.val_every steps; checkpoints every
save_every, and before stopping early on a signal or trainer.max_hours (preemption.py). The
steps trainer.trace picks leave a timeline of every rank (timeline.py); every
trainer.samples_every steps a sample table (samples.py) goes to output_dir and the trackers.

The driver-side pieces come first (scoring and advantages), then `PPOTrainer`; the recipes'
glue (dynamic sampling, overlong shaping, the update's masks and weights) is recipes.py.
Sampling goes through rollout_source.RolloutSource (actor replicas or separate rollout ranks);
with trainer.async_mode one_step or bounded, rollout_source.RolloutPipeline samples the next
batch while this one trains (one batch a step: dynamic sampling needs async_mode off); with
streaming, rollout_source.StreamingPipeline samples continuously in segments.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from rlhf.algorithms import (
    apply_kl_penalty,
    build_kl_controller,
    compute_advantage,
    estimator_needs,
    scores_to_token_rewards,
    sequence_scores,
)
from rlhf.config import TRAINED_ROLES, JobConfig, config_to_dict, job_roles, ref_from_actor
from rlhf.config.roles import ACTOR, CRITIC, REF
from rlhf.controller import RoleView
from rlhf.controller.nodes import check_user_files, user_files
from rlhf.data.batch import Batch
from rlhf.data.cost_model import RoleCost
from rlhf.data.dataset import PromptLoader, build_prompt_dataset
from rlhf.data.fields import response_mask
from rlhf.data.ragged import Ragged
from rlhf.engine.offload import PIN_METRICS
from rlhf.files import check_shared_folder
from rlhf.parallel.memory_probes import worst_memory
from rlhf.rewards import RewardRunner
from rlhf.rewards.runner import combine_scores
from rlhf.rollout import logprob_gap
from rlhf.rollout.routing import replays_routes
from rlhf.rollout.sampling import GAP_STATISTIC, check_logprob_gap, logprob_gap_limit
from rlhf.trainer import routing_replay
from rlhf.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state
from rlhf.trainer.device import actor_dtype
from rlhf.trainer.metrics import MetricsLogger, SectionTimer
from rlhf.trainer.preemption import Preempted, StopRequests
from rlhf.trainer.recipes import (
    fill_batch,
    prepare_update,
    rollout_corr_metrics,
    round_seed,
    shape_scores,
    truncated_responses,
)
from rlhf.trainer.rollout_source import (
    VERSION,
    RolloutPipeline,
    RolloutSource,
    streaming_pipeline,
)
from rlhf.trainer.samples import FUNCTION_SCORE, sample_table
from rlhf.trainer.step_splits import StepSplits, fuse_old_log_probs
from rlhf.trainer.timeline import Timeline
from rlhf.trainer.validation import validation_metrics


def step_seed(base: int, step: int) -> int:
    """The sampling seed of one step: a fixed function of (seed, step), so a resumed run
    samples exactly as an uninterrupted one would."""
    return (base * 1_000_003 + step * 7919) % 2**31


def decode_responses(batch: Batch, tokenizer) -> list[str]:
    """Response texts without special tokens (the EOS that stopped a response is dropped)."""
    return tokenizer.batch_decode([row.tolist() for row in batch["response_ids"].to_list()],
                                  skip_special_tokens=True)


def score_batch(batch: Batch, tokenizer, runner: RewardRunner, cfg: JobConfig, *,
                rm_scores: Tensor | None = None) -> tuple[Tensor, dict[str, float], Batch]:
    """(N,) float32 total rewards (functions + environment + reward model), the metrics, and
    each function's own scores (samples.FUNCTION_SCORE) and the reward model's as fields."""
    result = runner.score(batch["raw_prompt"], decode_responses(batch, tokenizer),
                          batch["ground_truth"], batch["extra"])
    parts = [result.scores]
    if "env_reward" in batch:  # multi-turn episodes: the environment's summed rewards
        parts.append(batch["env_reward"])
    scores = combine_scores(parts, [1.0] * len(parts), rm_scores=rm_scores,
                            rm_weight=cfg.reward.model_weight)
    metrics = {**result.metrics, "reward/mean": scores.mean().item(),
               "reward/max": scores.max().item(), "reward/min": scores.min().item()}
    if "env_reward" in batch:
        metrics["reward/env_mean"] = batch["env_reward"].float().mean().item()
    if rm_scores is not None:
        metrics["reward/rm_mean"] = rm_scores.float().mean().item()
    parts_N = {FUNCTION_SCORE + name: s for name, s in result.function_scores.items()}
    if rm_scores is not None:  # the sample tables show the reward model's share too
        parts_N["rm_scores"] = rm_scores.float()
    return scores, metrics, Batch(parts_N, size=len(batch))


def compute_advantages(batch: Batch, scores_N: Tensor, cfg: JobConfig,
                       kl_ctrl) -> tuple[Batch, dict[str, float]]:
    """`advantages` and `returns` (Ragged like response_ids) by algorithm.adv_estimator, with
    the in-reward KL penalty when algorithm.kl_in_reward (which also updates `kl_ctrl`).
    The estimator takes what it names of everything the step has (values when a critic ran)."""
    algo, responses = cfg.algorithm, batch["response_ids"]
    cu, mask_T = responses.offsets, response_mask(batch).values
    token_rewards_T = scores_to_token_rewards(scores_N.double(), cu, mask_T)
    metrics: dict[str, float] = {}
    if algo.kl_in_reward:
        token_rewards_T, kl_N = apply_kl_penalty(
            token_rewards_T, batch["old_log_probs"].values.double(),
            batch["ref_log_probs"].values.double(), mask_T, cu, coef=kl_ctrl.coef,
            kind=algo.kl_penalty)
        metrics["actor/kl_coef"] = kl_ctrl.coef
        metrics["reward/kl_penalty_mean"] = (kl_ctrl.coef * kl_N).mean().item()
        kl_ctrl.update(kl_N.mean().item(), len(batch))
    inputs = dict(token_rewards_T=token_rewards_T, cu_seqlens=cu, mask_T=mask_T,
                  scores_N=sequence_scores(token_rewards_T, cu, mask_T),  # KL folded in
                  group_ids=torch.arange(len(batch) // cfg.rollout.n).repeat_interleave(
                      cfg.rollout.n),
                  gamma=algo.gamma, lam=algo.lam, norm_adv_by_std=algo.norm_adv_by_std)
    if "values" in batch:
        inputs["values_T"] = batch["values"].values.double()
    advantages_T, returns_T = compute_advantage(algo.adv_estimator, **inputs)
    valid = mask_T.bool()
    if valid.any():
        metrics["advantages/mean"] = advantages_T[valid].mean().item()
        metrics["returns/mean"] = returns_T[valid].mean().item()
    out = Batch({"advantages": Ragged(advantages_T.float(), cu),
                 "returns": Ragged(returns_T.float(), cu)})
    return out, metrics


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Response lengths, tokens, and `actor/kl_ref`: the policy's KL to the reference before
    the update (k1 per token, old minus reference log-probs, token mean); the update's own
    policy-vs-old estimate is `actor/approx_kl`."""
    responses, mask_T = batch["response_ids"], response_mask(batch).values
    lengths = responses.lengths.float()
    metrics = {
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "prompt_length/mean": batch["prompt_ids"].lengths.float().mean().item(),
        "tokens/total": float(batch["prompt_ids"].values.numel() + responses.values.numel()),
    }
    if "entropy" in batch and mask_T.any():
        metrics["rollout/entropy"] = batch["entropy"].values[mask_T].mean().item()
    if "ref_log_probs" in batch and mask_T.any():
        diff = batch["old_log_probs"].values - batch["ref_log_probs"].values
        metrics["actor/kl_ref"] = diff[mask_T].mean().item()
    return metrics


VAL_SEED = 12345
# Roles whose methods run under rlhf.engine.offload.in_phase and report memory per call.
MEMORY_REPORTING_ROLES = (ACTOR, CRITIC, REF)


class PPOTrainer:
    """Drives `views` (actor, and critic / ref / reward when the config uses them)."""

    def __init__(self, cfg: JobConfig, views: dict[str, RoleView], *, tokenizer, job_name: str,
                 progress: bool = True, cost_models: Mapping[str, RoleCost] | None = None):
        self.cfg, self.views, self.tokenizer = cfg, views, tokenizer
        self.cost_models = cost_models  # trainer.micro_batching=cost_model: `rlhf profile`'s
        self.job_name, self.progress = job_name, progress
        self.output_dir = Path(cfg.trainer.output_dir)
        data = cfg.data
        self.loader = PromptLoader(build_prompt_dataset(data.train_files, tokenizer, data,
                                                        weights=data.train_weights),
                                   batch_size=data.train_batch_size, shuffle=data.shuffle,
                                   seed=data.seed)
        self.val_data = (build_prompt_dataset(data.val_files, tokenizer, data)
                         if data.val_files else None)
        algo = cfg.algorithm
        # What the estimator's registry entry needs (the config was checked before the workers
        # started: rlhf.preflight, trainer.jobs.job_workers).
        self.needs = estimator_needs(algo.adv_estimator)
        self.kl_ctrl = build_kl_controller(algo.kl_ctrl, coef=algo.kl_coef, target=algo.kl_target,
                                           horizon=algo.kl_horizon)
        self.ckpt = CheckpointManager(self.output_dir, max_keep=cfg.trainer.max_keep,
                                      full_hash=cfg.trainer.full_checkpoint_hash,
                                      background=cfg.trainer.async_checkpoint)
        self.runner: RewardRunner | None = None
        self.rollouts = RolloutSource(views, n=cfg.rollout.n)
        self.pipeline = None  # trainer.async_mode: sample batch k+1 while batch k trains
        if cfg.trainer.async_mode == "streaming":
            self.pipeline = streaming_pipeline(cfg, self.rollouts, lambda: next(self.loader))
        elif cfg.trainer.async_mode != "off":
            self.pipeline = RolloutPipeline(
                self.rollouts, self._prompts, max_staleness=cfg.trainer.max_staleness,
                total_steps=cfg.trainer.total_steps,
                old_from_rollout=cfg.trainer.async_old_log_probs == "rollout")

    # ---- the loop ----------------------------------------------------------------------------

    def fit(self, after_step: Callable[[int], None] | None = None) -> list[dict]:
        """Train to trainer.total_steps (resuming per trainer.resume); returns the new records.
        `after_step(step)`, if given, runs after each step is logged and saved, outside its
        timing (`rlhf bench step` runs its baseline's steps there)."""
        t = self.cfg.trainer
        self.ckpt.remove_stale()
        check_shared_folder(self.output_dir,  # every node writes checkpoint shards there
                            {r: self.views[r].read_marker for r in self._trained_roles()})
        check_user_files(user_files(self.cfg), self.views,
                         timeout_s=self.cfg.reward.import_timeout_s)
        start = self.resume()
        # Kept on the trainer: its Ray gauge actor lives as long as the logger does.
        self.logger = logger = MetricsLogger(
            self.output_dir, total_steps=t.total_steps, start_step=start, job_name=self.job_name,
            loggers=t.loggers, config=config_to_dict(self.cfg), ray_metrics=t.ray_metrics,
            progress=self.progress, wandb_project=t.wandb_project,
            mlflow_tracking_uri=t.mlflow_tracking_uri)
        records = []
        self.runner = RewardRunner.from_config(self.cfg.reward)
        timeline = Timeline(t, self.views, self.output_dir)  # trainer.trace
        try:
            with StopRequests(on_signal=t.save_on_signal, max_hours=t.max_hours) as stop:
                if start == 0 and t.val_every > 0 and t.val_before_train:
                    records.append(logger.log(0, self.validate()))
                for step in range(start + 1, t.total_steps + 1):
                    began = time.monotonic()
                    timeline.begin(step)
                    metrics = self.train_step(step)
                    if t.val_every > 0 and (step % t.val_every == 0 or step == t.total_steps):
                        metrics.update(self.validate())
                    metrics.update(timeline.end(step))  # outside timing/step
                    metrics.update(self.ckpt.poll())  # a save published since the last record
                    records.append(logger.log(step, metrics))
                    saved = None
                    if (t.save_every > 0 and step % t.save_every == 0) or step == t.total_steps:
                        saved = self.save(step)
                    if after_step is not None:
                        after_step(step)
                    stop.step_took(time.monotonic() - began)
                    if step < t.total_steps and (reason := stop.reason()) is not None:
                        saved = saved or self.save(step)
                        self.ckpt.wait()  # a background save is complete before the exit
                        raise Preempted(step=step, reason=reason,  # see preemption.py
                                        checkpoint=saved)
                self.ckpt.wait()  # the last save is on disk before the run ends
        except Exception as e:
            self.ckpt.settle(e)  # a background save of a sound cluster still completes
            raise
        finally:
            timeline.close()
            self.runner.close()
            if self.pipeline is not None:
                self.pipeline.close()
            logger.close()
        return records

    def train_step(self, step: int) -> dict[str, float]:
        """One PPO step on the next batch of prompts; returns its metrics."""
        cfg, views, timer = self.cfg, self.views, SectionTimer()
        version = self.rollouts.policy_version  # the policy that scores this batch
        with timer("step"):
            if self.pipeline is not None:  # async: the batch sampled while the last step trained
                batch, metrics = self.pipeline.next_batch(step, timer)
                batch, scores, score_metrics = self._score(batch, timer)
                metrics.update(score_metrics)
            else:
                seed = step_seed(cfg.rollout.seed, step)  # dynamic sampling: one batch per round
                batch, scores, metrics = fill_batch(
                    lambda r: next(self.loader).with_meta(seed=round_seed(seed, r)),
                    lambda prompts: self._generate_and_score(prompts, timer), cfg)
            splits = StepSplits(cfg, {k: v.layout.dp for k, v in views.items()}, batch,
                                cost_models=self.cost_models)
            fused = fuse_old_log_probs(cfg, self.needs, step=step)
            if not fused and "old_log_probs" not in batch:  # async: may be the rollout's
                with timer("old_log_prob"):
                    batch = batch.union(views["actor"].compute_log_prob(
                        batch, split=splits.forward("actor")))
                if replays_routes(cfg.rollout):  # MoE routing replay's figures
                    with timer("routing_check"):
                        metrics.update(routing_replay.before_update(
                            views["actor"], batch, splits.forward("actor"), cfg.rollout))
            if cfg.algorithm.use_ref:
                with timer("ref"):
                    ref = "actor" if ref_from_actor(cfg) else "ref"  # LoRA: the base is the ref
                    batch = batch.union(views[ref].compute_ref_log_prob(
                        batch, split=splits.forward(ref)))
            if self.needs.critic:
                with timer("values"):
                    batch = batch.union(views["critic"].compute_values(
                        batch, split=splits.forward("critic")))
            with timer("advantages"):
                advantages, adv_metrics = compute_advantages(batch, scores, cfg, self.kl_ctrl)
                batch = batch.union(advantages)
            batch, recipe_metrics = prepare_update(batch, cfg, self.tokenizer.eos_token_id)
            if not fused:  # checked before the update trains on the engine's samples
                metrics.update(self._logprob_gap(batch, version=version))
            update_metrics, batch = self._update(batch, splits, timer, step=step, fused=fused)
            if replays_routes(cfg.rollout):
                with timer("routing_check"):
                    metrics.update(routing_replay.after_update(
                        views["actor"], batch, splits.forward("actor"), cfg.rollout))
            if fused:  # the old log-probs came out of the update's first forward
                metrics.update(self._logprob_gap(batch, version=version))
            metrics.update(recipe_metrics or rollout_corr_metrics(batch, cfg))
        stats = batch_metrics(batch)
        metrics.update(adv_metrics, **update_metrics, **timer.seconds)
        metrics.update(stats)
        metrics["plan/imbalance"] = splits.imbalance
        if splits.fallback_fraction is not None:  # cost_model: where token_budget was kept
            metrics["plan/token_budget_fallback"] = splits.fallback_fraction
        for role in MEMORY_REPORTING_ROLES:  # each role method's worst rank, this step
            if role in views:
                report = worst_memory(views[role].memory_metrics())
                # every role reports its pinned memory under one name: file it by role
                metrics.update({f"{k}/{role}" if k in PIN_METRICS else k: v
                                for k, v in report.items()})
        metrics["throughput/tokens_per_s"] = stats["tokens/total"] / timer.seconds["timing/step"]
        if cfg.trainer.samples(step):
            self.logger.log_samples(step, sample_table(
                batch, scores, lambda rows: decode_responses(rows, self.tokenizer),
                truncated_N=truncated_responses(batch, cfg, self.tokenizer.eos_token_id),
                rows=cfg.trainer.samples_rows))
        return metrics

    def _generate_and_score(self, prompts: Batch,
                            timer: SectionTimer) -> tuple[Batch, Tensor, dict[str, float]]:
        """Samples of `prompts`, their scores and the rollout and reward metrics."""
        batch, metrics = self._rollout(prompts, timer, greedy=False)
        batch, scores, score_metrics = self._score(batch, timer)
        return batch, scores, {**metrics, **score_metrics}

    def _score(self, batch: Batch, timer: SectionTimer) -> tuple[Batch, Tensor, dict[str, float]]:
        """Sampled `batch` with each reward function's scores, its total scores (reward
        functions, reward model, overlong shaping) and the reward metrics."""
        cfg = self.cfg
        with timer("reward"):
            rm = None
            if cfg.reward.model_path:
                split = StepSplits(cfg, {"reward": self.views["reward"].layout.dp}, batch,
                                   cost_models=self.cost_models)
                rm = self.views["reward"].compute_rm_score(
                    batch, split=split.forward("reward"))["rm_scores"]
            scores, reward_metrics, functions = score_batch(batch, self.tokenizer, self.runner,
                                                            cfg, rm_scores=rm)
            scores, shape_metrics = shape_scores(batch, scores, cfg, self.tokenizer.eos_token_id)
        return batch.union(functions), scores, {**reward_metrics, **shape_metrics}

    def _prompts(self, step: int) -> Batch:
        return next(self.loader).with_meta(seed=step_seed(self.cfg.rollout.seed, step))

    def _rollout(self, prompts: Batch, timer: SectionTimer, *, greedy: bool,
                 n: int | None = None) -> tuple[Batch, dict]:
        with timer("sync_weights"):
            sync = self.rollouts.sync()
        with timer("generate"):
            out = self.rollouts.generate(prompts, greedy=greedy)
        batch, metrics = self.rollouts.assemble(prompts, out, greedy=greedy, n=n,
                                                version=self.rollouts.policy_version)
        return batch, {**metrics, **sync}

    def _logprob_gap(self, batch: Batch, *, version: int) -> dict[str, float]:
        """rollout/logprob_gap_* over the batch; stops the job when the p99 gap of the samples
        a synced engine drew with `version`, the policy whose old log-probs they carry, is
        above rollout.max_logprob_gap_p99 (by the actor's dtype when null). Version 0 is
        model.path, which vLLM loaded itself, and older samples (async) differ by the policy's
        own updates, so neither is checked."""
        if "rollout_log_probs" not in batch:
            return {}
        metrics = dict(logprob_gap(batch["old_log_probs"], batch["rollout_log_probs"],
                                   mask=response_mask(batch)))
        if version == 0 or VERSION not in batch:
            return metrics
        rows = torch.nonzero(batch[VERSION] == version).flatten().tolist()
        if rows:
            part = batch if len(rows) == len(batch) else batch.select(rows)
            gap = metrics if part is batch else logprob_gap(
                part["old_log_probs"], part["rollout_log_probs"], mask=response_mask(part))
            dtype = actor_dtype(self.cfg)
            check_logprob_gap(gap[f"rollout/logprob_gap_{GAP_STATISTIC}"],
                              limit=logprob_gap_limit(self.cfg.rollout, dtype), dtype=dtype)
        return metrics

    def _update(self, batch: Batch, splits: StepSplits, timer: SectionTimer, *, step: int,
                fused: bool) -> tuple[dict[str, float], Batch]:
        """Critic then actor updates; returns their metrics and the batch, with the old
        log-probs and entropy the actor's update computed when `fused`."""
        metrics = {}
        if self.needs.critic:
            with timer("update_critic"):
                metrics.update(self.views["critic"].update_critic(
                    batch, split=splits.update("critic")))
            if step <= self.cfg.trainer.critic_warmup:
                return metrics, batch
        with timer("update_actor"):
            result = self.views["actor"].update_actor(batch, split=splits.update("actor"))
        self.rollouts.policy_changed()
        if fused:
            result, fields = result
            batch = batch.union(fields)
        metrics.update(result)
        return metrics, batch

    def validate(self) -> dict[str, float]:
        """A greedy answer to every held-out prompt (val/reward_mean@greedy, alias
        val/accuracy), and with trainer.val_sampling.n, n sampled answers (pass@k); overall
        and per data source (rlhf.trainer.validation)."""
        loader = PromptLoader(self.val_data, batch_size=self.cfg.data.val_batch_size,
                              shuffle=False, drop_last=False)
        sampling = self.cfg.trainer.val_sampling
        timer, sources, greedy, sampled, lengths = SectionTimer(), [], [], [], []
        with timer("validate"):
            for _ in range(loader.batches_per_epoch):
                prompts = next(loader).with_meta(seed=VAL_SEED)
                batch, _ = self._rollout(prompts, timer, greedy=True)
                batch_scores, _, _ = score_batch(batch, self.tokenizer, self.runner, self.cfg)
                sources += prompts["data_source"]
                greedy += batch_scores.tolist()
                lengths += batch["response_ids"].lengths.tolist()
                if sampling.n:
                    settings = {"n": sampling.n, "temperature": sampling.temperature,
                                "top_p": sampling.top_p, "top_k": sampling.top_k}
                    batch, _ = self._rollout(prompts.with_meta(sampling=settings), timer,
                                             greedy=False, n=sampling.n)
                    batch_scores, _, _ = score_batch(batch, self.tokenizer, self.runner, self.cfg)
                    sampled += batch_scores.view(len(prompts), sampling.n).tolist()
        return {**validation_metrics(sources, greedy, sampled or None,
                                     pass_score=sampling.pass_score),
                "val/response_length": sum(lengths) / len(lengths),
                "timing/validate": timer.seconds["timing/validate"]}

    # ---- checkpoints -------------------------------------------------------------------------

    def save(self, step: int) -> Path:
        """Checkpoint every trained role, the data position, RNG and KL controller states."""
        state = {"step": step, "loader": self.loader.state_dict(), "rng": rng_state(),
                 "kl_ctrl": self.kl_ctrl.state_dict(), "config": config_to_dict(self.cfg),
                 "rollouts": (self.pipeline or self.rollouts).state_dict()}
        return self.ckpt.save(step, roles={r: self.views[r] for r in self._trained_roles()},
                              state=state)

    def resume(self) -> int:
        """Restore the checkpoint trainer.resume names, if any; returns its step (else 0)."""
        folder = self.ckpt.resolve(self.cfg.trainer.resume)
        if folder is None:
            return 0
        state = self.ckpt.load_state(folder)
        for role in self._trained_roles():
            self.views[role].load_checkpoint(str(folder / role))
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        set_rng_state(state["rng"])
        if "rollouts" in state:  # checkpoints before async training have none
            (self.pipeline or self.rollouts).load_state_dict(state["rollouts"])
        print(f"resumed from {folder} (step {state['step']})", flush=True)
        return int(state["step"])

    def export_policy(self, folder: Path) -> Path:
        """The actor's weights as a Hugging Face folder."""
        self.views["actor"].export_hf(str(folder), self.cfg.model.path)
        return folder

    def _trained_roles(self) -> list[str]:
        return [role for role in job_roles(self.cfg, self.needs) if role in TRAINED_ROLES]
