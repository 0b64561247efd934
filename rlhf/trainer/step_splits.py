"""The driver's batch splits for one PPO step: every role call's mini- and micro-batches per DP group,
and the one decision whether old log-probs get their own pass.

The driver sees every sample and every role's layout, so it splits and the workers execute
(see rlhf/data/batch_split.py). Calls that split alike (same DP size, budget, sample cap and
mini-batch size: say the actor's and the reference's forward passes) share one split. With
trainer.micro_batching=cost_model each role's pass is cut by its measured cost model
(`rlhf profile`; rlhf.data.micro_batching), the pipeline order chosen by simulating the
role's schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial

from rlhf.config import AlgorithmNeeds, JobConfig
from rlhf.data.batch import Batch
from rlhf.data.batch_split import BatchSplit, role_budget, split_batch, split_role_batch
from rlhf.data.cost_model import RoleCost
from rlhf.data.fields import sample_lengths
from rlhf.data.micro_batching import CostPlan, memory_limit
from rlhf.data.packing import shared_prompt_lens
from rlhf.engine.pipeline_order import forward_only_order, training_orders


def fuse_old_log_probs(cfg: JobConfig, needs: AlgorithmNeeds, *, step: int) -> bool:
    """Whether update_actor takes the old log-probs from its own first forward instead of a
    separate compute_log_prob pass: only when the update is on-policy (one PPO epoch of one
    mini-batch, so the old policy is the current one there), nothing before the update reads
    them (no KL in the reward, no rollout correction on the driver), the actor updates at this
    step (after the warm-up of a critic `needs` calls for) and the old policy is the trainer's
    (not the sampling version's, trainer.async_old_log_probs)."""
    algo, rollout, trainer = cfg.algorithm, cfg.rollout, cfg.trainer
    one_step = algo.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
    actor_updates = not (needs.critic and step <= trainer.critic_warmup)
    old_is_rollout = trainer.async_mode != "off" and trainer.async_old_log_probs == "rollout"
    return (one_step and not algo.kl_in_reward and not rollout.corrects_on_driver
            and actor_updates and not old_is_rollout)


def cost_plan(role, cost: RoleCost, phase: str) -> CostPlan:
    """How the cost-model planner cuts `phase` ("forward", "forward_backward") of a role
    config: its measured cost, the memory its token budget allows, its pipeline schedule, and
    the gain over the token budget's plan it must predict (its fit's median error)."""
    pp, vpp = role.parallel.pp, role.parallel.vpp
    orders = (partial(_forward_orders, pp=pp, vpp=vpp) if phase == "forward"
              else partial(_training_orders, pp=pp, vpp=vpp))
    measured = cost.phase(phase)
    margin = (cost.fit or {}).get(phase, {}).get("time_median_abs_rel_error", 0.0)
    return CostPlan(measured, memory_limit(measured, role.max_tokens_per_micro_batch), pp=pp,
                    vpp=vpp, orders_for=orders if pp > 1 else None,
                    forward=cost.phases.get("forward"), margin=min(margin, 0.9))


def schedule_lengths(cfg: JobConfig, n: int, *, most: int) -> list[int]:
    """n sample lengths spread geometrically from 16 tokens to the longest a sample can be
    (prompt + response, at most `most`): an RL batch's long tail, to choose a schedule before
    any batch exists."""
    longest = max(16, min(most, cfg.data.max_prompt_length + cfg.rollout.max_response_tokens))
    return [round(16 * (longest / 16) ** (i / max(1, n - 1))) for i in range(n)]


def predicted_role_step(cfg: JobConfig, role, cost: RoleCost, dp: int) -> float:
    """The cost model's seconds for a role's passes in one step at `role`'s layout: a
    forward over the batch, and for a trained role its update's mini-batches (one epoch)."""
    samples = cfg.data.train_batch_size * cfg.rollout.n
    budget, max_seqs = role_budget(role)
    lengths = schedule_lengths(cfg, samples, most=budget)
    passes = [("forward", None)]
    if "forward_backward" in cost.phases and hasattr(role, "ppo_mini_batch_size"):
        passes.append(("forward_backward", role.ppo_mini_batch_size * cfg.rollout.n))
    total = 0.0
    for phase, mini in passes:
        split = split_batch(lengths, dp=dp, max_tokens=budget, mini_size=mini,
                            max_seqs=max_seqs, cost_plan=cost_plan(role, cost, phase))
        total += sum(max(costs) for costs in split.group_costs)
    return total


def choose_schedules(cfg: JobConfig, cost_models: Mapping[str, RoleCost],
                     dp: Mapping[str, int]) -> tuple[JobConfig, dict[str, dict[int, float]]]:
    """With trainer.pipeline_schedule=auto: the config with each pipelined role at
    parallel.vpp > 1 set to the vpp (1: 1F1B, or its own: interleaved) whose step the cost
    model predicts faster, and per such role {vpp: predicted seconds}; else `cfg` unchanged."""
    if cfg.trainer.pipeline_schedule != "auto":
        return cfg, {}
    changes, predicted = {}, {}
    for key in sorted(cost_models):
        role = getattr(cfg, key)
        if role.parallel.pp == 1 or role.parallel.vpp == 1:
            continue
        options = {vpp: dataclasses.replace(role, parallel=dataclasses.replace(
            role.parallel, vpp=vpp)) for vpp in (1, role.parallel.vpp)}
        predicted[key] = {vpp: predicted_role_step(cfg, r, cost_models[key], dp[key])
                          for vpp, r in options.items()}
        best = min(predicted[key], key=lambda v: (predicted[key][v], v))
        changes[key] = options[best]
    return dataclasses.replace(cfg, **changes), predicted


def _forward_orders(m: int, *, pp: int, vpp: int):
    return [forward_only_order(m, pp=pp, vpp=vpp)] * pp


def _training_orders(m: int, *, pp: int, vpp: int):
    return training_orders(m, pp=pp, vpp=vpp)[0]


class StepSplits:
    """Splits the role calls of one step on `batch`; `dp` maps role key -> its DP size;
    `cost_models` (role key -> RoleCost) cut them when trainer.micro_batching is cost_model."""

    def __init__(self, cfg: JobConfig, dp: Mapping[str, int], batch: Batch, *,
                 cost_models: Mapping[str, RoleCost] | None = None):
        self.cfg, self.dp = cfg, dict(dp)
        self.cost_models = cost_models if cfg.trainer.micro_batching == "cost_model" else None
        if cfg.trainer.micro_batching == "cost_model" and cost_models is None:
            raise ValueError("trainer.micro_batching=cost_model needs the roles' cost models: "
                             "run `rlhf profile CONFIG`, then pass them (rlhf train loads them)")
        self.lengths = sample_lengths(batch)
        self.shared = shared_prompt_lens(batch["prompt_ids"])
        self._splits: dict[tuple, BatchSplit] = {}

    def forward(self, key: str) -> BatchSplit:
        """The split of a forward pass of role `key` (actor, ref, critic, reward) on the batch."""
        return self._split(key, mini_size=None, what="")

    def update(self, key: str) -> BatchSplit:
        """The split of role `key`'s (actor, critic) PPO update on the batch."""
        mini = getattr(self.cfg, key).ppo_mini_batch_size * self.cfg.rollout.n
        what = f"{key}.ppo_mini_batch_size * rollout.n"
        if mini < self.dp[key]:
            raise ValueError(f"{what} = {mini} samples per optimizer step cannot give each of "
                             f"the {key}'s {self.dp[key]} DP groups a sample; raise "
                             f"{key}.ppo_mini_batch_size or use fewer DP groups")
        return self._split(key, mini_size=mini, what=what)

    @property
    def fallback_fraction(self) -> float | None:
        """Of the cost-model plans made so far, the share where the token budget's plan ran
        (the cost model's not predicted faster by more than its margin); None without one."""
        flags = [f for p in self._splits.values() for f in p.fallbacks]
        return sum(flags) / len(flags) if self.cost_models is not None and flags else None

    @property
    def imbalance(self) -> float:
        """The worst max-over-mean group cost of any split made so far (1.0: perfect)."""
        return max((p.imbalance for p in self._splits.values()), default=1.0)

    def _split(self, key: str, *, mini_size: int | None, what: str) -> BatchSplit:
        role = getattr(self.cfg, key)
        spec = (self.dp[key], mini_size, *role_budget(role), role.share_prompts,
                role.parallel.ep > 1)  # ep > 1 keeps empty micro-batches
        plan = None
        if self.cost_models is not None:
            if key not in self.cost_models:
                raise ValueError(f"the cost models have no role {key!r}; run `rlhf profile "
                                 "CONFIG` on this job's config")
            phase = "forward" if mini_size is None else "forward_backward"
            plan = cost_plan(role, self.cost_models[key], phase)
            spec = (*spec, key, phase)  # each role's pass has its own measured cost
        if spec not in self._splits:
            self._splits[spec] = split_role_batch(self.lengths, role, dp=self.dp[key],
                                                  mini_size=mini_size, what=what,
                                                  shared=self.shared, cost_plan=plan)
        return self._splits[spec]
