"""vLLM's residual in the plan: rollout.sleep_residual_gb (a run's measured
rollout/sleep_residual_gb fed back) on every rank hosting vLLM, in every phase, less vLLM's own
communicator, which has a line of its own; null estimates the CUDA-graph pool alone."""

from pathlib import Path

import pytest

from rlhf.config import load_config
from rlhf.plan.inputs import GIB, VLLM_GRAPH_POOL_BYTES, vllm_residual
from rlhf.plan.memory import VLLM_RESIDUAL, plan_job
from rlhf.plan.report import format_plan

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MULTIGPU = CONFIGS / "qwen2.5-7b_ppo_multigpu.yaml"
MODELS = (CONFIGS / "models",)


def _plan(*overrides):
    return plan_job(load_config(MULTIGPU, list(overrides)), model_dirs=MODELS)


def _lines(plan, key):
    return {(d.pool, r): {p: parts.get(key, 0) for p, parts in d.phases.items()}
            for d in plan.devices for r in d.ranks}


@pytest.mark.parametrize("tp", [1, 2])
def test_the_configured_residual_is_on_every_vllm_rank_in_every_phase(tp):
    plan = _plan(f"rollout.tp={tp}", "rollout.sleep_residual_gb=4.5")
    communicator = _lines(plan, "nccl vllm tp")
    for rank, phases in _lines(plan, VLLM_RESIDUAL).items():
        for phase, residual in phases.items():
            # the measured figure holds vLLM's tp communicator; the plan counts it once
            assert residual + communicator[rank][phase] == int(4.5 * GIB), (rank, phase)
    assert bool(communicator[("shared", 0)]["sync"]) is (tp > 1)


def test_a_fed_back_residual_moves_every_phase_by_the_difference():
    low, high = _plan("rollout.sleep_residual_gb=3"), _plan("rollout.sleep_residual_gb=5")
    for a, b in zip(low.devices, high.devices):
        assert a.ranks == b.ranks
        for phase in a.phases:
            assert b.total(phase) - a.total(phase) == 2 * GIB, phase
    text = format_plan(high, [], title="x")
    assert "vllm residual from rollout.sleep_residual_gb=5" in text


def test_null_estimates_the_graph_pool_and_nothing_with_eager_and_ranks_without_vllm_hold_none():
    cfg = load_config(MULTIGPU, ["rollout.sleep_residual_gb=null"])
    assert vllm_residual(cfg) == (VLLM_GRAPH_POOL_BYTES, "estimate (rollout.sleep_residual_gb "
                                                         "null): CUDA-graph pool")
    eager = load_config(MULTIGPU, ["rollout.sleep_residual_gb=null", "rollout.enforce_eager=true"])
    assert vllm_residual(eager)[0] == 0
    assert all(not any(p.values()) for p in _lines(plan_job(eager, model_dirs=MODELS),
                                                   VLLM_RESIDUAL).values())
    # separate rollout ranks hold vLLM (and its residual); the actor's ranks do not
    plan = _plan("rollout.placement=separate", "rollout.world_size=8",
                 "rollout.sleep_residual_gb=2")
    for (pool, _), phases in _lines(plan, VLLM_RESIDUAL).items():
        assert set(phases.values()) == ({2 * GIB - _nccl_vllm(plan)} if pool == "rollout"
                                        else {0}), pool


def _nccl_vllm(plan):
    rollout = next(d for d in plan.devices if d.pool == "rollout")
    return rollout.phases["generate"].get("nccl vllm tp", 0)


def test_a_negative_residual_is_refused_by_name():
    with pytest.raises(Exception, match="sleep_residual_gb must be >= 0"):
        load_config(MULTIGPU, ["rollout.sleep_residual_gb=-1"])
