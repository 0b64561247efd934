"""The launcher edge of a rollout engine: process settings that vLLM only reads from the
environment, derived from the job config in one place and set only while an engine is built."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from rlhf.errors import ConfigError


def engine_settings(*, device_type: str, launcher_rank: int | None = None,
                    device_index: int = 0) -> dict[str, str]:
    """What vLLM reads from the environment while this process builds an engine.

    The engine core runs in this process (the rank's Ray actor) rather than in a child of its
    own; on the CPU, Ray already gave the rank its cores, so vLLM must not pin OpenMP threads.
    The model is a local folder, so the hub stays offline. `launcher_rank`: this process's rank
    in the job's torch.distributed world when a replica spans several ranks (vLLM's external
    launcher reads it as RANK, and LOCAL_RANK as the CUDA index it runs on: `device_index`, the
    rank's device as rlhf.controller.device resolved it, 0 unless
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES leaves every GPU visible).
    """
    if device_type == "cuda" and launcher_rank is None and device_index != 0:
        # vLLM's one-process executor takes its CUDA index from the device type string
        # ("cuda", so 0), not from the current device: every such engine would share GPU 0.
        raise ConfigError(
            f"this rank runs on cuda:{device_index}, but a one-rank vLLM engine (rollout.tp=1) "
            "always places itself on cuda:0 of the visible GPUs; start Ray without "
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES (so each rank sees its own GPU as "
            "cuda:0) or use rollout.tp > 1")
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                # vLLM's own handler prints INFO lines to stdout; through Python logging only
                # warnings reach stderr, and stdout stays for results (benchmarks print JSON).
                "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "0"),
                # forked tokenizers deadlock
                "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false")}
    if device_type == "cpu":
        settings["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if launcher_rank is not None:
        settings.update(RANK=str(launcher_rank), LOCAL_RANK=str(device_index))
    return settings


@contextmanager
def engine_environment(*, device_type: str, launcher_rank: int | None = None,
                       device_index: int = 0) -> Iterator[None]:
    """`engine_settings` in os.environ around an engine's construction, each key restored
    afterwards (removed if it was unset), so no child process of the rank inherits them.

    Nothing needs them once the engine is built: vLLM reads its VLLM_* settings through its
    `envs` module, which the engine core caches when it starts (vllm.envs.enable_envs_cache),
    and the external launcher reads RANK and LOCAL_RANK when it joins the job's world. What
    vLLM writes into the environment itself is vLLM's and stays.
    """
    settings = engine_settings(device_type=device_type, launcher_rank=launcher_rank,
                               device_index=device_index)
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
