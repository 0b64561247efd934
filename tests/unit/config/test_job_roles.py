"""config.job_roles is the one list of the roles a job creates (whether a critic is one is the
advantage estimator's registry entry's answer, algorithm_needs); the trainer's set-up, the
pool check of preflight, the config checks and the memory planner all read it."""

import dataclasses
from pathlib import Path

import pytest

from rlhf.algorithms import algorithm_needs
from rlhf.config import TRAINED_ROLES, ConfigError, load_config
from rlhf.config.roles import ROLES, job_roles
from rlhf.preflight import _jobs, pool_problems

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MODELS = (CONFIGS / "models",)


def _cfg(path, *overrides):
    return load_config(CONFIGS / path, list(overrides))


def roles_of(cfg):
    return job_roles(cfg, algorithm_needs(cfg))


CASES = {  # config and overrides -> roles, written out by hand
    "ppo": (("quickstart.yaml",), ["actor", "critic", "ref"]),
    "grpo": (("grpo_quickstart.yaml",), ["actor", "ref"]),
    "no KL, no ref": (("grpo_quickstart.yaml", "algorithm.use_kl_loss=false",
                       "algorithm.kl_in_reward=false"), ["actor"]),
    "separate rollout": (("quickstart.yaml", "rollout.placement=separate",
                          "rollout.world_size=2"), ["actor", "critic", "ref", "rollout"]),
}


@pytest.mark.parametrize("name", CASES)
def test_job_roles_by_hand(name):
    args, want = CASES[name]
    cfg = _cfg(*args)
    roles = roles_of(cfg)
    assert list(roles) == want
    assert all(roles[n] is getattr(cfg, n) for n in roles)  # each role's own section
    assert TRAINED_ROLES == ("actor", "critic") and set(want) <= set(ROLES)


def test_a_reward_model_is_a_role():
    cfg = _cfg("quickstart.yaml")
    cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, model_path="rm"))
    assert list(roles_of(cfg)) == ["actor", "critic", "ref", "reward"]


@pytest.mark.parametrize("name", CASES)
def test_setup_preflight_checks_and_planner_read_the_same_roles(name):
    from rlhf.plan.inputs import hardware, role_specs
    from rlhf.trainer.jobs import job_workers

    cfg = _cfg(*CASES[name][0])
    roles = list(roles_of(cfg))
    workers, sections = job_workers(cfg)
    assert list(workers) == list(sections) == roles
    assert [workers[n][0].__name__ for n in roles] == [
        {"actor": "ActorWorker", "critic": "CriticWorker", "ref": "ReferenceWorker",
         "rollout": "RolloutWorker"}[n] for n in roles]
    ((label, pooled),) = _jobs(cfg, "train")
    assert list(pooled) == roles
    model_roles = [n for n in roles if n != "rollout"]  # the rollout pool holds vLLM only
    specs = role_specs(cfg, hardware(cfg), model_dirs=MODELS)
    assert [s.name for s in specs] == model_roles
    assert [s.trains for s in specs] == [n in TRAINED_ROLES for n in model_roles]


def test_the_critic_s_checks_run_exactly_when_the_estimator_takes_values():
    bad = ("critic.parallel.tp=3",)  # divides neither the pool nor the heads
    with pytest.raises(ConfigError, match=r"critic\.parallel\.tp"):
        algorithm_needs(_cfg("quickstart.yaml", *bad))
    assert not algorithm_needs(_cfg("grpo_quickstart.yaml", *bad)).critic


def test_the_pool_check_counts_a_separate_rollout_pool():
    cfg = _cfg("quickstart.yaml", "rollout.placement=separate", "rollout.world_size=2")
    problems = pool_problems(cfg, "train", cpus=3, gpus=None, where="here")
    assert problems and "needs 4 ranks" in problems[0] and "rollout.world_size=2" in problems[0]
