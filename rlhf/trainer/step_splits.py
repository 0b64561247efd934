"""The driver's batch splits for one PPO step: every role call's mini- and micro-batches per DP group,
and the one decision whether old log-probs get their own pass.

The driver sees every sample and every role's layout, so it splits and the workers execute
(see rlhf/data/batch_split.py). Calls that split alike (same DP size, budget, sample cap and
mini-batch size: say the actor's and the reference's forward passes) share one split.
"""

from __future__ import annotations

from collections.abc import Mapping

from rlhf.config import AlgorithmNeeds, JobConfig
from rlhf.data.batch import Batch
from rlhf.data.batch_split import BatchSplit, role_budget, split_role_batch
from rlhf.data.fields import sample_lengths
from rlhf.data.packing import shared_prompt_lens


def fuse_old_log_probs(cfg: JobConfig, needs: AlgorithmNeeds, *, step: int) -> bool:
    """Whether update_actor takes the old log-probs from its own first forward instead of a
    separate compute_log_prob pass: only when the update is on-policy (one PPO epoch of one
    mini-batch, so the old policy is the current one there), nothing before the update reads
    them (no KL in the reward, no sequence-level rollout correction), the actor updates at this
    step (after the warm-up of a critic `needs` calls for) and the old policy is the trainer's
    (not the sampling version's, trainer.async_old_log_probs)."""
    algo, rollout, trainer = cfg.algorithm, cfg.rollout, cfg.trainer
    one_step = algo.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
    actor_updates = not (needs.critic and step <= trainer.critic_warmup)
    seq_correction = rollout.seq_tis_cap is not None or rollout.reject_band is not None
    old_is_rollout = trainer.async_mode != "off" and trainer.async_old_log_probs == "rollout"
    return (one_step and not algo.kl_in_reward and not seq_correction and actor_updates
            and not old_is_rollout)


class StepSplits:
    """Splits the role calls of one step on `batch`; `dp` maps role key -> its DP size."""

    def __init__(self, cfg: JobConfig, dp: Mapping[str, int], batch: Batch):
        self.cfg, self.dp = cfg, dict(dp)
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
    def imbalance(self) -> float:
        """The worst max-over-mean group cost of any split made so far (1.0: perfect)."""
        return max((p.imbalance for p in self._splits.values()), default=1.0)

    def _split(self, key: str, *, mini_size: int | None, what: str) -> BatchSplit:
        role = getattr(self.cfg, key)
        spec = (self.dp[key], mini_size, *role_budget(role), role.share_prompts,
                role.parallel.ep > 1)  # ep > 1 keeps empty micro-batches
        if spec not in self._splits:
            self._splits[spec] = split_role_batch(self.lengths, role, dp=self.dp[key],
                                                  mini_size=mini_size, what=what,
                                                  shared=self.shared)
        return self._splits[spec]
