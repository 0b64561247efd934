"""`rlhf doctor`: checks that the installed environment can run the system.

Besides imports and versions it checks what the GPU path needs: flash-attn (import, and one
varlen call against the SDPA path on CUDA), vLLM against the tested range (pyproject's `gpu`
extra, via rlhf.rollout.compat), NCCL, and the GPUs an existing Ray cluster sees.
"""

import importlib
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlhf.families import FAMILIES

# One causal-LM class per family the engine supports, plus the classes reward models load from.
MODEL_CLASSES = (*(f.causal_lm_class for f in FAMILIES), "LlamaForSequenceClassification",
                 "Qwen2ForTokenClassification", "AutoModelForCausalLM")
# Written into the environment by examples/install.sh when flash-attn did not build or load.
FLASH_ATTN_FAILED = ".rlhf-flash-attn-failed"
# bf16 output of the same attention through two kernels; a broken kernel is off by O(1).
FLASH_TOLERANCE = 2e-2


@dataclass
class Findings:
    """What the checks found: `name: value` lines, problems (fail) and warnings (do not)."""

    lines: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def run_doctor() -> int:
    """Import every heavy dependency, check the GPU path, print the findings; return an exit code."""
    found = Findings(lines={"python": platform.python_version()})
    for module in ("torch", "transformers", "tokenizers", "safetensors", "ray", "vllm"):
        start = time.perf_counter()
        try:
            found.lines[module] = importlib.import_module(module).__version__
        except Exception as exc:  # report every broken import, not just the first
            found.problems.append(f"import {module} failed: {type(exc).__name__}: {exc}")
            continue
        found.lines[module] += f" ({time.perf_counter() - start:.1f}s)"
    try:
        transformers = importlib.import_module("transformers")
        for name in MODEL_CLASSES:
            getattr(transformers, name)
    except Exception as exc:
        found.problems.append(f"transformers model classes do not load: {type(exc).__name__}: "
                              f"{exc}. A torchvision/torchaudio build made for another torch is "
                              "the usual cause: re-run examples/install.sh, or pip uninstall "
                              "torchvision.")
    cuda = False
    if "torch" in found.lines:
        import torch

        cuda = torch.cuda.is_available()
        found.lines["device"] = (f"cuda x{torch.cuda.device_count()} "
                                 f"({torch.cuda.get_device_name(0)})" if cuda else "cpu")
    if "vllm" in found.lines:
        check_vllm_range(found)
    if "torch" in found.lines:
        check_flash_attn(found, device="cuda" if cuda else None)
        check_nccl(found, cuda=cuda)
    if "ray" in found.lines:
        check_ray_gpus(found, cuda=cuda)
    return report(found)


def report(found: Findings) -> int:
    """Print the findings; 1 when there is a problem, else 0."""
    for key, value in found.lines.items():
        print(f"  {key:13s} {value}")
    for warning in found.warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    for problem in found.problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    warned = f" ({len(found.warnings)} warning(s))" if found.warnings else ""
    print(f"environment OK{warned}" if not found.problems
          else f"{len(found.problems)} problem(s) found{warned}")
    return 1 if found.problems else 0


def check_vllm_range(found: Findings) -> None:
    """The imported vLLM against the range the weight sync was tested with."""
    from rlhf.rollout.compat import TESTED_VLLM, in_tested_range, installed_vllm_version

    version = installed_vllm_version()
    if in_tested_range(version):
        found.lines["vllm range"] = f"ok ({version} in the tested range {TESTED_VLLM})"
        return
    found.lines["vllm range"] = f"OUTSIDE ({version} not in the tested range {TESTED_VLLM})"
    found.problems.append(
        f"vLLM {version} is outside the range the weight sync was tested with ({TESTED_VLLM}): "
        "the sync calls vLLM internals that change between minor releases. Re-run "
        f"examples/install.sh, or pip install 'vllm{TESTED_VLLM}'")


def check_flash_attn(found: Findings, *, device: str | None) -> None:
    """flash-attn's import, and on `device` (None: no CUDA, no call) one varlen call checked
    against the SDPA path; a failed build recorded by examples/install.sh is reported."""
    try:
        flash_attn = importlib.import_module("flash_attn")
        flash_attn.flash_attn_varlen_func  # noqa: B018 - what the attention path imports
    except Exception as exc:  # absent, or built against another torch
        recorded = Path(sys.prefix) / FLASH_ATTN_FAILED
        if recorded.is_file():
            found.lines["flash-attn"] = "NOT INSTALLED: its build failed in examples/install.sh"
            found.warnings.append(
                f"flash-attn did not build or load when examples/install.sh ran; packed "
                f"attention on CUDA falls back to SDPA (slower). Why, from {recorded}:\n"
                + recorded.read_text(encoding="utf-8", errors="replace").rstrip())
        elif device is None:
            found.lines["flash-attn"] = "not installed (not used without CUDA)"
        else:
            found.lines["flash-attn"] = f"NOT INSTALLED ({type(exc).__name__}: {exc})"
            found.warnings.append(
                "flash-attn does not import, so packed attention on CUDA falls back to SDPA "
                "(slower); examples/install.sh builds it (pip install flash-attn "
                "--no-build-isolation)")
        return
    version = getattr(flash_attn, "__version__", "of unknown version")
    if device is None:
        found.lines["flash-attn"] = f"{version} (imports; no CUDA device for a varlen call)"
        return
    try:
        error = flash_varlen_error(device)
    except Exception as exc:  # a kernel that raises is the finding
        found.lines["flash-attn"] = f"{version}: varlen call FAILED"
        found.problems.append(f"flash-attn's varlen kernel raised on {device}: "
                              f"{type(exc).__name__}: {exc}")
        return
    if error > FLASH_TOLERANCE:
        found.lines["flash-attn"] = f"{version}: varlen call WRONG"
        found.problems.append(f"flash-attn's varlen kernel differs from the SDPA path by {error:.3g} "
                              f"(> {FLASH_TOLERANCE}) on {device}: reinstall flash-attn against "
                              "this torch (examples/install.sh)")
        return
    found.lines["flash-attn"] = (f"{version}, varlen call on {device} ok "
                                 f"(max |diff| vs SDPA {error:.2g})")


def flash_varlen_error(device: str) -> float:
    """Max |flash_varlen - sdpa_varlen| over two packed causal sequences with grouped-query
    heads in bf16 on `device`: the project's own kernel paths, one call each."""
    import torch

    from rlhf.models.attention import flash_varlen, sdpa_varlen

    generator = torch.Generator().manual_seed(0)
    lens, heads, kv_heads, head_dim = (5, 11), 4, 2, 64
    total = sum(lens)
    q_THD, k_THD, v_THD = (
        torch.randn(total, h, head_dim, generator=generator).to(device, torch.bfloat16)
        for h in (heads, kv_heads, kv_heads))
    cu_seqlens = torch.tensor([0, lens[0], total], dtype=torch.int32, device=device)
    args = dict(cu_seqlens=cu_seqlens, max_seqlen=max(lens), causal=True,
                scale=head_dim ** -0.5)
    flash = flash_varlen(q_THD, k_THD, v_THD, **args)
    reference = sdpa_varlen(q_THD, k_THD, v_THD, **args)
    return (flash.float() - reference.float()).abs().max().item()


def check_nccl(found: Findings, *, cuda: bool) -> None:
    """The NCCL version torch was built with (CUDA only)."""
    if not cuda:
        found.lines["nccl"] = "not checked (no CUDA device; CPU jobs use gloo)"
        return
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception as exc:
        found.lines["nccl"] = "NOT AVAILABLE"
        found.problems.append(f"torch cannot report its NCCL ({type(exc).__name__}: {exc}); GPU "
                              "jobs communicate over NCCL: install a CUDA build of torch")
        return
    if not torch.distributed.is_nccl_available():
        found.lines["nccl"] = "NOT AVAILABLE"
        found.problems.append("torch.distributed was built without NCCL; GPU jobs communicate "
                              "over NCCL: install a CUDA build of torch")
        return
    found.lines["nccl"] = (".".join(map(str, version)) if isinstance(version, tuple)
                           else str(version))


def check_ray_gpus(found: Findings, *, cuda: bool) -> None:
    """The GPUs of the Ray cluster a job would join (RAY_ADDRESS, else one `ray start` made on
    this node); never starts a cluster."""
    try:
        address = ray_address()
    except ValueError as exc:  # e.g. RAY_ADDRESS holds the dashboard's http:// address
        found.lines["ray gpus"] = "not connected (RAY_ADDRESS is not a cluster address)"
        found.warnings.append(f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r}: {exc}")
        return
    if address is None:
        found.lines["ray gpus"] = ("not connected (no RAY_ADDRESS, no `ray start` cluster on "
                                   "this node): a job starts a local Ray")
        return
    if not answers(address):
        found.lines["ray gpus"] = f"not connected (nothing answers at {address})"
        found.warnings.append(f"the Ray cluster at {address} (RAY_ADDRESS or `ray start`) does "
                              "not answer; start it, or unset RAY_ADDRESS")
        return
    import ray

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        gpus = ray.cluster_resources().get("GPU", 0)
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    except Exception as exc:
        found.lines["ray gpus"] = f"not connected ({type(exc).__name__}: {exc})"
        return
    finally:
        ray.shutdown()
    found.lines["ray gpus"] = f"{gpus:g} GPUs on {nodes} node(s) at {address}"
    if cuda and not gpus:
        found.warnings.append(f"this node has CUDA but the Ray cluster at {address} has no GPUs: "
                              "run `ray start` where CUDA_VISIBLE_DEVICES shows the GPUs, or give "
                              "it --num-gpus")


def ray_address() -> str | None:
    """host:port of the cluster to ask: RAY_ADDRESS, else the one `ray start` recorded here;
    None when neither; ValueError when RAY_ADDRESS is not a cluster address."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # a Ray without this helper: only RAY_ADDRESS is known
        return os.environ.get("RAY_ADDRESS") or None
    try:
        return canonicalize_bootstrap_address(None)
    except ConnectionError:
        return None
    except Exception as exc:
        raise ValueError(str(exc)) from None


def answers(address: str, *, timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to host:port opens; ray.init waits a minute on a dead address."""
    host, _, port = address.rpartition("://")[2].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
