"""The workers' environment is set at the launcher edge from the config: NCCL_NVLS_ENABLE=0
exactly when trainer.nccl_nvls is off (the memory planner reads the same key)."""

from pathlib import Path

from rlhf.config import load_config
from rlhf.trainer.jobs import worker_env

# a config whose model folder no run writes into the checkout
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "qwen2.5-7b_ppo_multigpu.yaml"


def test_nvls_off_in_the_config_is_off_in_every_worker():
    on = worker_env(load_config(CONFIG))
    off = worker_env(load_config(CONFIG, ["trainer.nccl_nvls=false"]))
    assert "NCCL_NVLS_ENABLE" not in on  # NCCL's own default: on where the hardware has it
    assert off["NCCL_NVLS_ENABLE"] == "0"
    assert {k: v for k, v in off.items() if k != "NCCL_NVLS_ENABLE"} == on
    assert on["OMP_NUM_THREADS"] == "1"
