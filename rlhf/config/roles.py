"""Which roles a job creates: their names, and the rule that picks them from a config.

The names are written here once; everything else (the trainer's set-up, the checks, the
planner, checkpoints) imports them. Whether a critic is trained is a fact of the advantage
estimator's registry entry, which this leaf cannot import: callers pass the `AlgorithmNeeds`
that `rlhf.algorithms.algorithm_needs` reads from the registries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: schema imports nothing from here
    from rlhf.config.schema import ForwardRoleConfig, JobConfig, RolloutConfig

ACTOR, CRITIC, REF, REWARD, ROLLOUT = "actor", "critic", "ref", "reward", "rollout"
ROLES = (ACTOR, CRITIC, REF, REWARD, ROLLOUT)  # in build order
TRAINED_ROLES = (ACTOR, CRITIC)  # the roles with an optimizer, whose state a checkpoint holds


@dataclass(frozen=True, kw_only=True)
class AlgorithmNeeds:
    """What the configured algorithm entries need beyond the actor and the rewards."""

    critic: bool = False
    """The advantage estimator takes values: a critic is trained."""
    groups: bool = False
    """The advantage estimator compares the rollout.n responses of each prompt."""


def ref_from_actor(cfg: JobConfig) -> bool:
    """Whether the actor computes the reference log-probs itself: with actor.lora on, its frozen
    base (adapters disabled) is the reference policy (model.path), so no reference role is built."""
    return cfg.algorithm.use_ref and cfg.actor.lora.enabled


def job_roles(cfg: JobConfig, needs: AlgorithmNeeds) -> dict[str, ForwardRoleConfig | RolloutConfig]:
    """The roles a PPO job creates, in build order, each with its config section: the actor;
    the critic when `needs.critic`; the reference when algorithm.use_ref (unless
    `ref_from_actor`); the reward model when reward.model_path is set; the rollout pool when
    rollout.placement is separate."""
    roles: dict[str, ForwardRoleConfig | RolloutConfig] = {ACTOR: cfg.actor}
    if needs.critic:
        roles[CRITIC] = cfg.critic
    if cfg.algorithm.use_ref and not ref_from_actor(cfg):
        roles[REF] = cfg.ref
    if cfg.reward.model_path is not None:
        roles[REWARD] = cfg.reward
    if cfg.rollout.placement == "separate":
        roles[ROLLOUT] = cfg.rollout
    return roles
