"""The workers' environment is set at the launcher edge from the config: NCCL_NVLS_ENABLE=0
exactly when trainer.nccl_nvls is off (the memory planner reads the same key)."""

import os
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


def test_a_local_cluster_starts_with_the_workers_environment_and_no_runtime_env(monkeypatch):
    """The raylet passes its environment to the workers it prestarts; a runtime_env would
    leave those idle. The driver's own environment is put back after the start."""
    import ray

    from rlhf.trainer import jobs

    cfg = load_config(CONFIG, ["trainer.nccl_nvls=false"])
    seen = {}

    def fake_init(**kwargs):
        seen["kwargs"] = kwargs
        seen["env"] = {k: os.environ.get(k) for k in jobs.worker_env(cfg)}

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    jobs.init_ray(cfg, env_address=None)
    assert "runtime_env" not in seen["kwargs"] and "address" not in seen["kwargs"]
    assert seen["env"] == jobs.worker_env(cfg)
    assert os.environ["OMP_NUM_THREADS"] == "7" and "NCCL_NVLS_ENABLE" not in os.environ
