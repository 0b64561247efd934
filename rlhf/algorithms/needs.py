"""The configured algorithm entries looked up in their registries, and what they need.

The config (a leaf) keeps each choice as a string; `algorithm_needs` is the check at the layer
that can import the registries: it runs before any process starts (`rlhf train`, `rlhf plan`,
the trainer), names the key of every unknown name (with the closest registered one) or user
function that does not load or cannot be called as the trainer calls it, and answers what the
entries need: a critic, groups of responses (and, through them, the critic role's checks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from rlhf.algorithms.advantages import CRITIC_INPUT, GROUP_INPUT, advantage_inputs
from rlhf.algorithms.group_filters import NO_FILTER, get_group_filter
from rlhf.algorithms.kl import FIXED, get_kl, get_kl_controller
from rlhf.algorithms.losses import get_loss_agg
from rlhf.algorithms.policy_losses import POLICY_LOSS_KEYWORDS, get_policy_loss
from rlhf.config.checks import raise_problems, role_problems
from rlhf.config.roles import CRITIC, AlgorithmNeeds
from rlhf.config.schema import JobConfig


def algorithm_needs(cfg: JobConfig) -> AlgorithmNeeds:
    """What cfg.algorithm's entries need; one ConfigError naming every key whose entry is
    unknown, does not load, cannot take the trainer's arguments or lacks what it needs."""
    algo = cfg.algorithm
    problems: list[str] = []
    needs = None  # unknown until the estimator loads
    try:
        needs = estimator_needs(algo.adv_estimator)
    except ValueError as e:
        problems.append(f"algorithm.adv_estimator: {e}")
    _check_call(problems, "algorithm.policy_loss", get_policy_loss, algo.policy_loss,
                args=5, keywords=POLICY_LOSS_KEYWORDS)
    for key in ("kl_penalty", "kl_loss_type"):
        _check_call(problems, f"algorithm.{key}", get_kl, getattr(algo, key), args=2)
    _check_call(problems, "algorithm.loss_agg_mode", get_loss_agg, algo.loss_agg_mode, args=4)
    problems += _controller_problems(cfg)
    if needs is not None:  # what else the estimator's entry needs, once it loaded
        problems += _needs_problems(cfg, needs)
    raise_problems(problems)
    return needs or AlgorithmNeeds()  # None only with problems, which were raised


def estimator_needs(name: str) -> AlgorithmNeeds:
    """What advantage estimator `name` needs, read from its parameters, without the config's
    checks (the roles of a checked job ask this); ValueError when it does not load."""
    takes, _ = advantage_inputs(name)
    return AlgorithmNeeds(critic=CRITIC_INPUT in takes, groups=GROUP_INPUT in takes)


def _needs_problems(cfg: JobConfig, needs: AlgorithmNeeds) -> list[str]:
    algo, rollout, problems = cfg.algorithm, cfg.rollout, []
    if needs.groups and rollout.n < 2:
        problems.append(f"algorithm.adv_estimator={algo.adv_estimator} compares responses of "
                        f"the same prompt: set rollout.n to at least 2 (got {rollout.n})")
    if needs.groups and rollout.temperature == 0 and rollout.n > 1:
        problems.append("rollout.temperature=0 (greedy) makes the rollout.n responses of a "
                        "prompt identical, so group advantages are all zero; use a temperature "
                        "above 0")
    if algo.dynamic_sampling != NO_FILTER:
        problems += _filter_problems(cfg, needs)
    if needs.critic:
        problems += role_problems(cfg, {CRITIC: cfg.critic})
    return problems


def _filter_problems(cfg: JobConfig, needs: AlgorithmNeeds) -> list[str]:
    algo, problems = cfg.algorithm, []
    fn = _check_call(problems, "algorithm.dynamic_sampling", get_group_filter,
                     algo.dynamic_sampling, args=2, keywords=("std_threshold",))
    if fn is not None and _requires(fn, "std_threshold") and algo.dynamic_sampling_std <= 0:
        problems.append(f"algorithm.dynamic_sampling={algo.dynamic_sampling} needs a positive "
                        f"algorithm.dynamic_sampling_std, got {algo.dynamic_sampling_std}; set "
                        f"one (e.g. 0.1) or use algorithm.dynamic_sampling=all_equal")
    if not needs.groups:
        problems.append(f"algorithm.dynamic_sampling={algo.dynamic_sampling} filters prompt "
                        f"groups by their reward spread; use a group estimator (one that "
                        f"takes {GROUP_INPUT}, e.g. grpo, rloo) for algorithm.adv_estimator, or "
                        f"set algorithm.dynamic_sampling={NO_FILTER}")
    return problems


def _check_call(problems: list[str], key: str, get: Callable[[str], Callable], name: str, *,
                args: int, keywords: tuple[str, ...] = ()) -> Callable | None:
    """The entry `get(name)`, or None with a problem added when it is unknown, does not load,
    or cannot be called with `args` positional arguments and `keywords` as the trainer does."""
    try:
        fn = get(name)
    except ValueError as e:
        problems.append(f"{key}: {e}")
        return None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # no signature to check (some C callables): trust it
    try:
        signature.bind(*range(args), **dict.fromkeys(keywords))
    except TypeError as e:
        problems.append(f"{key}: {name!r} has signature {signature}, which cannot take the "
                        f"trainer's call ({args} positional arguments"
                        f"{', keywords ' + ', '.join(keywords) if keywords else ''}): {e}; "
                        f"add the missing parameters (or **kwargs)")
    return fn


def _controller_problems(cfg: JobConfig) -> list[str]:
    algo, problems = cfg.algorithm, []
    factory = _check_call(problems, "algorithm.kl_ctrl", get_kl_controller, algo.kl_ctrl,
                          args=1, keywords=("target", "horizon"))
    if factory is None or algo.kl_ctrl == FIXED:
        return problems
    if _requires(factory, "target") and algo.kl_target is None:
        problems.append(f"algorithm.kl_ctrl={algo.kl_ctrl} steers the KL towards a target: set "
                        f"algorithm.kl_target (a KL per sequence, e.g. 6.0)")
    if not algo.kl_in_reward:
        problems.append(f"algorithm.kl_ctrl={algo.kl_ctrl} tunes the in-reward KL penalty: set "
                        f"algorithm.kl_in_reward=true or algorithm.kl_ctrl={FIXED}")
    return problems


def _requires(fn: Callable, param: str) -> bool:
    p = inspect.signature(fn).parameters.get(param)
    return p is not None and p.default is p.empty
