"""The PPO/GRPO loop: one controller drives the role worker groups step by step.

One step (see workers/common.py for the fields each call reads and writes):
sync weights -> generate -> rewards (with dynamic sampling, repeated on fresh prompts until the
batch is full: dynamic_sampling.py) -> old log-probs -> ref log-probs -> values -> advantages
(driver) -> masks and weights of the recipes (recipes.py) -> critic update -> actor update;
every phase timed. Every role call gets the driver's plan of its mini- and micro-batches
(step_plan.py); on-policy, the old log-probs come from the actor update's first forward instead
of their own pass. Validation (greedy, held-out prompts) every trainer.val_every steps;
checkpoints every save_every.
Sampling goes through async_loop.RolloutSource (actor replicas or separate rollout ranks); with
trainer.async_mode on, async_loop.RolloutPipeline samples the next batch while this one trains
(one batch a step: dynamic sampling needs async_mode off).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from rlhf.algorithms import build_kl_controller
from rlhf.config import TRAINED_ROLES, JobConfig, config_to_dict, job_roles
from rlhf.controller import RoleView
from rlhf.data.batch import Batch
from rlhf.data.dataset import PromptLoader, build_prompt_dataset
from rlhf.data.fields import response_mask
from rlhf.engine.offload import worst_memory
from rlhf.rewards import RewardRunner
from rlhf.rollout import logprob_gap
from rlhf.rollout.sampling import check_logprob_gap
from rlhf.trainer.async_loop import VERSION, RolloutPipeline, RolloutSource
from rlhf.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state
from rlhf.trainer.dynamic_sampling import fill_batch, round_seed
from rlhf.trainer.metrics import MetricsLogger, PhaseTimer
from rlhf.trainer.phases import batch_metrics, compute_advantages, score_batch, step_seed
from rlhf.trainer.recipes import prepare_update, rollout_corr_metrics, shape_scores
from rlhf.trainer.step_plan import StepPlanner, fuse_old_log_probs
from rlhf.trainer.shared_folder import check_shared_folder, check_user_files, user_files

VAL_SEED = 12345
# Roles whose methods run under rlhf.engine.offload.in_phase and report memory per call.
MEMORY_REPORTING_ROLES = ("actor", "critic", "ref")


class PPOTrainer:
    """Drives `views` (actor, and critic / ref / reward when the config uses them)."""

    def __init__(self, cfg: JobConfig, views: dict[str, RoleView], *, tokenizer, job_name: str,
                 progress: bool = True):
        self.cfg, self.views, self.tokenizer = cfg, views, tokenizer
        self.job_name, self.progress = job_name, progress
        self.output_dir = Path(cfg.trainer.output_dir)
        data = cfg.data
        self.loader = PromptLoader(build_prompt_dataset(data.train_files, tokenizer, data),
                                   batch_size=data.train_batch_size, shuffle=data.shuffle,
                                   seed=data.seed)
        self.val_data = (build_prompt_dataset(data.val_files, tokenizer, data)
                         if data.val_files else None)
        algo = cfg.algorithm
        self.kl_ctrl = build_kl_controller(algo.kl_ctrl, coef=algo.kl_coef, target=algo.kl_target,
                                           horizon=algo.kl_horizon)
        self.ckpt = CheckpointManager(self.output_dir, max_keep=cfg.trainer.max_keep)
        self.runner: RewardRunner | None = None
        self.rollouts = RolloutSource(views, n=cfg.rollout.n)
        self.pipeline = None  # trainer.async_mode: sample batch k+1 while batch k trains
        if cfg.trainer.async_mode != "off":
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
            tensorboard=t.tensorboard, ray_metrics=t.ray_metrics, progress=self.progress)
        records = []
        self.runner = RewardRunner.from_config(self.cfg.reward)
        try:
            if start == 0 and t.val_every > 0 and t.val_before_train:
                records.append(logger.log(0, self.validate()))
            for step in range(start + 1, t.total_steps + 1):
                metrics = self.train_step(step)
                if t.val_every > 0 and (step % t.val_every == 0 or step == t.total_steps):
                    metrics.update(self.validate())
                records.append(logger.log(step, metrics))
                if (t.save_every > 0 and step % t.save_every == 0) or step == t.total_steps:
                    self.save(step)
                if after_step is not None:
                    after_step(step)
        finally:
            self.runner.close()
            logger.close()
        return records

    def train_step(self, step: int) -> dict[str, float]:
        """One PPO step on the next batch of prompts; returns its metrics."""
        cfg, views, timer = self.cfg, self.views, PhaseTimer()
        version = self.rollouts.policy_version  # the policy that scores this batch
        with timer("step"):
            if self.pipeline is not None:  # async: the batch sampled while the last step trained
                batch, metrics = self.pipeline.next_batch(step, timer)
                scores, score_metrics = self._score(batch, timer)
                metrics.update(score_metrics)
            else:
                seed = step_seed(cfg.rollout.seed, step)  # dynamic sampling: one batch per round
                batch, scores, metrics = fill_batch(
                    lambda r: next(self.loader).with_meta(seed=round_seed(seed, r)),
                    lambda prompts: self._generate_and_score(prompts, timer), cfg)
            plans = StepPlanner(cfg, {k: v.layout.dp for k, v in views.items()}, batch)
            fused = fuse_old_log_probs(cfg, step=step)
            if not fused and "old_log_probs" not in batch:  # async: may be the rollout's
                with timer("old_log_prob"):
                    batch = batch.union(views["actor"].compute_log_prob(
                        batch, plan=plans.forward("actor")))
            if cfg.algorithm.use_ref:
                with timer("ref"):
                    batch = batch.union(views["ref"].compute_ref_log_prob(
                        batch, plan=plans.forward("ref")))
            if cfg.algorithm.use_critic:
                with timer("values"):
                    batch = batch.union(views["critic"].compute_values(
                        batch, plan=plans.forward("critic")))
            with timer("advantages"):
                advantages, adv_metrics = compute_advantages(batch, scores, cfg, self.kl_ctrl)
                batch = batch.union(advantages)
            batch, recipe_metrics = prepare_update(batch, cfg, self.tokenizer.eos_token_id)
            if not fused:  # checked before the update trains on the engine's samples
                metrics.update(self._logprob_gap(batch, version=version))
            update_metrics, batch = self._update(batch, plans, timer, step=step, fused=fused)
            if fused:  # the old log-probs came out of the update's first forward
                metrics.update(self._logprob_gap(batch, version=version))
            metrics.update(recipe_metrics or rollout_corr_metrics(batch, cfg))
        stats = batch_metrics(batch)
        metrics.update(adv_metrics, **update_metrics, **timer.seconds)
        metrics.update(stats)
        metrics["plan/imbalance"] = plans.imbalance
        for role in MEMORY_REPORTING_ROLES:  # each role method's worst rank, this step
            if role in views:
                metrics.update(worst_memory(views[role].memory_metrics()))
        metrics["throughput/tokens_per_s"] = stats["tokens/total"] / timer.seconds["timing/step"]
        return metrics

    def _generate_and_score(self, prompts: Batch,
                            timer: PhaseTimer) -> tuple[Batch, Tensor, dict[str, float]]:
        """Samples of `prompts`, their scores and the rollout and reward metrics."""
        batch, metrics = self._rollout(prompts, timer, greedy=False)
        scores, score_metrics = self._score(batch, timer)
        return batch, scores, {**metrics, **score_metrics}

    def _score(self, batch: Batch, timer: PhaseTimer) -> tuple[Tensor, dict[str, float]]:
        """Scores of sampled `batch` (reward functions, reward model, overlong shaping) and
        the reward metrics."""
        cfg = self.cfg
        with timer("reward"):
            rm = None
            if cfg.reward.model_path:
                plan = StepPlanner(cfg, {"reward": self.views["reward"].layout.dp}, batch)
                rm = self.views["reward"].compute_rm_score(
                    batch, plan=plan.forward("reward"))["rm_scores"]
            scores, reward_metrics = score_batch(batch, self.tokenizer, self.runner, cfg,
                                                 rm_scores=rm)
            scores, shape_metrics = shape_scores(batch, scores, cfg, self.tokenizer.eos_token_id)
        return scores, {**reward_metrics, **shape_metrics}

    def _prompts(self, step: int) -> Batch:
        return next(self.loader).with_meta(seed=step_seed(self.cfg.rollout.seed, step))

    def _rollout(self, prompts: Batch, timer: PhaseTimer, *, greedy: bool) -> tuple[Batch, dict]:
        with timer("sync_weights"):
            sync = self.rollouts.sync()
        with timer("generate"):
            out = self.rollouts.generate(prompts, greedy=greedy)
        batch, metrics = self.rollouts.assemble(prompts, out, greedy=greedy,
                                                version=self.rollouts.policy_version)
        return batch, {**metrics, **sync}

    def _logprob_gap(self, batch: Batch, *, version: int) -> dict[str, float]:
        """rollout/logprob_gap_* over the batch; stops the job (rollout.max_logprob_gap) when
        the samples a synced engine drew with `version`, the policy whose old log-probs they
        carry, are too far from them. Version 0 is model.path, which vLLM loaded itself, and
        older samples (async) differ by the policy's own updates, so neither is checked."""
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
            check_logprob_gap(gap["rollout/logprob_gap_max"],
                              limit=self.cfg.rollout.max_logprob_gap)
        return metrics

    def _update(self, batch: Batch, plans: StepPlanner, timer: PhaseTimer, *, step: int,
                fused: bool) -> tuple[dict[str, float], Batch]:
        """Critic then actor updates; returns their metrics and the batch, with the old
        log-probs and entropy the actor's update computed when `fused`."""
        metrics = {}
        if self.cfg.algorithm.use_critic:
            with timer("update_critic"):
                metrics.update(self.views["critic"].update_critic(
                    batch, plan=plans.update("critic")))
            if step <= self.cfg.trainer.critic_warmup:
                return metrics, batch
        with timer("update_actor"):
            result = self.views["actor"].update_actor(batch, plan=plans.update("actor"))
        self.rollouts.policy_changed()
        if fused:
            result, fields = result
            batch = batch.union(fields)
        metrics.update(result)
        return metrics, batch

    def validate(self) -> dict[str, float]:
        """Greedy responses to every held-out prompt: val/accuracy is their mean reward."""
        loader = PromptLoader(self.val_data, batch_size=self.cfg.data.val_batch_size,
                              shuffle=False, drop_last=False)
        timer, scores, lengths = PhaseTimer(), [], []
        with timer("validate"):
            for _ in range(loader.batches_per_epoch):
                prompts = next(loader).with_meta(seed=VAL_SEED)
                batch, _ = self._rollout(prompts, timer, greedy=True)
                batch_scores, _ = score_batch(batch, self.tokenizer, self.runner, self.cfg)
                scores += batch_scores.tolist()
                lengths += batch["response_ids"].lengths.tolist()
        return {"val/accuracy": sum(scores) / len(scores),
                "val/response_length": sum(lengths) / len(lengths),
                "timing/validate": timer.seconds["timing/validate"]}

    # ---- checkpoints -------------------------------------------------------------------------

    def save(self, step: int) -> Path:
        """Checkpoint every trained role, the data position, RNG and KL controller states."""
        def write_roles(folder: Path) -> None:
            for role in self._trained_roles():
                self.views[role].save_checkpoint(str(folder / role))

        state = {"step": step, "loader": self.loader.state_dict(), "rng": rng_state(),
                 "kl_ctrl": self.kl_ctrl.state_dict(), "config": config_to_dict(self.cfg),
                 "rollouts": (self.pipeline or self.rollouts).state_dict()}
        return self.ckpt.save(step, write_roles=write_roles, state=state)

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
        return [role for role in job_roles(self.cfg) if role in TRAINED_ROLES]

