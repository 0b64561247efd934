"""The launcher edge of a rollout engine: process settings that vLLM only reads from the
environment, derived from the job config in one place instead of being read as settings."""

from __future__ import annotations

import os


def configure_engine_process(*, device_type: str, launcher_rank: int | None = None) -> None:
    """Set what vLLM reads from the environment before this process builds its first engine.

    The engine core runs in this process (the rank's Ray actor) rather than in a child of its
    own; on the CPU, Ray already gave the rank its cores, so vLLM must not pin OpenMP threads.
    The model is a local folder, so the hub stays offline. `launcher_rank`: this process's rank
    in the job's torch.distributed world when a replica spans several ranks (vLLM's external
    launcher reads it as RANK; Ray shows each rank its own GPU, so LOCAL_RANK is 0).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    # vLLM's own handler prints INFO lines to stdout; through Python logging only warnings
    # reach stderr, and stdout stays for results (benchmarks print JSON there).
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked tokenizers deadlock
    if device_type == "cpu":
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if launcher_rank is not None:
        os.environ["RANK"] = str(launcher_rank)
        os.environ["LOCAL_RANK"] = "0"
