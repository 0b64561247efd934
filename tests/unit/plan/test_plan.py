"""The memory planner on the shipped configs, its advice, `rlhf plan` and the train-time check.

(Exactness of the state bytes against real engines is in tests/dist/test_plan_exact.py.)
"""

import dataclasses
import json
from pathlib import Path

import pytest

from rlhf.cli import main
from rlhf.config import load_config
from rlhf.errors import ConfigError
from rlhf.plan.advice import plan_with_advice, with_overrides
from rlhf.plan.inputs import GIB, hardware, role_specs
from rlhf.plan.memory import in_flight_chunks, layer_activation_bytes, plan_job, stage_memory
from rlhf.plan.report import check_fits

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
MULTIGPU = CONFIGS / "qwen2.5-7b_ppo_multigpu.yaml"
MODELS = (CONFIGS / "models",)


def _plan(path, *overrides):
    return plan_job(load_config(path, list(overrides)), model_dirs=MODELS)


def test_quickstart_fits_a_cpu_machine_with_vllm_resident_in_every_phase():
    plan = _plan(QUICKSTART, "trainer.device_memory_gb=8")
    assert plan.hardware.device_type == "cpu" and plan.fits
    assert set(plan.roles) == {"actor", "critic", "ref"}
    (device,) = plan.devices  # one machine holds every rank (a vLLM replica per rank)
    kv = 2 * int(0.5 * GIB)  # 2 ranks x rollout.cpu_kv_cache_gb of the quickstart
    for phase, parts in device.phases.items():
        assert parts["vllm kv_cache"] == kv, phase  # vLLM never sleeps on the CPU
    full_model = plan.vllm["weights"]  # rollout.tp = 1: vLLM holds the whole model
    assert device.phases["sync"]["sync bucket"] == 2 * 2 * full_model  # 2 ranks; < 256 MiB
    actor = plan.stages["actor"][0]
    # fp32 on the CPU: no separate masters, grads fp32 like the weights; ZeRO-1 over dp 2:
    # each rank keeps half of Adam's two moments
    assert plan.roles["actor"].dp == 2 and plan.roles["actor"].zero1
    assert actor.state["masters"] == 0
    assert actor.state["weights"] <= actor.state["grads"] <= actor.state["weights"] + 4
    assert actor.state["optimizer"] == 2 * actor.state["grads"] // 2


def test_separate_rollout_ranks_hold_vllm_and_the_actor_ranks_none():
    plan = _plan(QUICKSTART, "trainer.device_memory_gb=8", "rollout.placement=separate",
                 "rollout.world_size=2")
    shared, rollout = plan.devices
    assert (shared.pool, rollout.pool, rollout.ranks) == ("shared", "rollout", (0, 1))
    assert not any(k.startswith(("vllm", "sync bucket")) for p in shared.phases.values()
                   for k in p)
    for phase, parts in rollout.phases.items():  # resident: no training state, never asleep
        assert parts["vllm kv_cache"] == 2 * int(0.5 * GIB), phase
        assert not any(k.startswith(("actor", "critic", "ref")) for k in parts)


def test_7b_config_fits_one_node_of_eight_80gb_gpus_as_shipped():
    cfg = load_config(MULTIGPU)
    plan = plan_job(cfg, model_dirs=MODELS)
    assert plan.hardware.device_type == "cuda" and cfg.trainer.pool_size == 8
    assert plan.fits, plan.peak / GIB
    assert {d.ranks for d in plan.devices} == {(0, 1, 2, 3), (4, 5, 6, 7)}
    generate = plan.devices[0].phases["generate"]
    # offloaded roles leave the GPU to vLLM while it generates, and come back to compute
    assert not any(k.startswith(("critic", "ref")) for k in generate)
    assert "critic optimizer" in plan.devices[0].phases["update critic"]
    assert plan.vllm["weights"] + plan.vllm["kv_cache"] == int(
        cfg.rollout.gpu_memory_utilization * plan.hardware.device_bytes)


def test_7b_config_without_its_memory_settings_does_not_fit_and_advice_does():
    undo = ["actor.optim.distributed=false", "critic.optim.distributed=false",
            "critic.offload={params: false, grads: false, optimizer: false}",
            "ref.offload.params=false"]
    cfg = load_config(MULTIGPU, undo)
    plan, advice = plan_with_advice(cfg, model_dirs=MODELS)
    assert not plan.fits
    fitting = [a for a in advice if a.fits]
    assert fitting and all(a.peak <= plan.hardware.device_bytes < plan.peak for a in fitting)
    for a in fitting[:3]:  # what the advice says fits does fit when applied
        assert plan_job(with_overrides(cfg, a.overrides), model_dirs=MODELS).fits, a


def test_zero1_divides_masters_and_moments_by_dp():
    cfg = load_config(MULTIGPU)
    specs = {s.name: s for s in role_specs(cfg, hardware(cfg), model_dirs=MODELS)}
    critic = specs["critic"]
    stage = stage_memory(critic)[0]
    sharded = stage.state
    replicated = stage_memory(dataclasses.replace(critic, shards=1))[0].state
    assert stage.replicated_state == replicated  # what the table shows "without zero1"
    assert critic.dp == 2 and critic.zero1
    for kind in ("masters", "optimizer"):
        assert replicated[kind] / 2 <= sharded[kind] < replicated[kind] / 2 + 4 * 2**25
    assert sharded["weights"] == replicated["weights"]


def test_activation_estimates_shrink_with_recompute_and_sequence_parallelism():
    cfg = load_config(MULTIGPU)
    actor = next(s for s in role_specs(cfg, hardware(cfg), model_dirs=MODELS)
                 if s.name == "actor")
    none, sel, full = (layer_activation_bytes(actor, r) for r in ("none", "attention_block", "full"))
    assert full < sel < none
    no_sp = dataclasses.replace(actor, parallel=dataclasses.replace(actor.parallel,
                                                                    sequence_parallel=False))
    assert layer_activation_bytes(no_sp, "full") == 4 * layer_activation_bytes(actor, "full")
    # 1F1B: rank r holds pp - r micro-batches; interleaved: Megatron's warm-up + 1 chunks
    assert [in_flight_chunks(4, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_chunks(2, 2, 0) == 5 and in_flight_chunks(2, 2, 1) == 3
    assert in_flight_chunks(1, 1, 0) == 1


def test_a_missing_model_folder_names_the_fix_and_train_warns_instead(tmp_path, capsys):
    absent = [f"model.path={tmp_path / 'absent'}", "model.tiny=null", "sft.total_steps=0"]
    with pytest.raises(ConfigError, match="configs/models"):
        _plan(QUICKSTART, *absent)
    # the driver may not see a folder the workers' nodes have: nothing to predict, no refusal
    check_fits(load_config(QUICKSTART, absent), config_path=QUICKSTART)
    assert "warning: no memory check" in capsys.readouterr().err


def test_cli_plan_prints_json_and_exits_1_when_it_does_not_fit(capsys):
    assert main(["plan", "--json", str(QUICKSTART), "trainer.device_memory_gb=8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["device_type"] == "cpu" and out["advice"] == []
    assert main(["plan", str(QUICKSTART), "trainer.device_memory_gb=0.01"]) == 1
    text = capsys.readouterr().out
    assert "does not fit" in text and "per device and phase" in text


