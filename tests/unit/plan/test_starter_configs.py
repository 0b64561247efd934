"""The configs users start from (GRPO 7B on 1 x 8 GPUs, its LoRA variant, a 0.5B model on one
GPU) load, describe the job their header promises, and fit by `rlhf plan`."""

from pathlib import Path

import pytest

from rlhf.config import load_config
from rlhf.plan.inputs import GIB
from rlhf.plan.memory import plan_job

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MODELS = (CONFIGS / "models",)


@pytest.mark.parametrize("name, gpus, lora, actor_tp", [
    ("grpo_qwen2.5-7b_1x8.yaml", 8, False, 4),
    ("grpo_qwen2.5-7b_1x8_lora.yaml", 8, True, 1),
    ("grpo_qwen2.5-0.5b_1x1.yaml", 1, False, 1),
])
def test_starter_config_fits_as_shipped(name, gpus, lora, actor_tp):
    cfg = load_config(CONFIGS / name, ["trainer.host_memory_gb=1000"])
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.trainer.device == "cuda"
    assert cfg.trainer.pool_size == gpus and cfg.actor.lora.enabled == lora
    assert cfg.actor.parallel.tp == actor_tp
    assert [f.path for f in cfg.reward.functions] == ["rlhf.rewards.gsm8k:score"]
    assert cfg.trainer.val_sampling.n > 0  # pass@k beside the greedy score
    plan = plan_job(cfg, model_dirs=MODELS)
    assert plan.fits, f"{name}: peak {plan.peak / GIB:.2f} GiB"
    assert plan.peak <= 0.95 * plan.hardware.device_bytes  # some headroom, not a knife edge
    assert ("ref" in plan.roles) != lora  # LoRA's reference is the frozen base
