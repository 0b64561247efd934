"""`rlhf doctor`: checks that the installed environment can run the system."""

import importlib
import platform
import sys
import time

# One causal-LM class per family the engine supports, plus the classes reward models load from.
MODEL_CLASSES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
    "LlamaForSequenceClassification", "Qwen2ForTokenClassification", "AutoModelForCausalLM",
)


def run_doctor() -> int:
    """Import every heavy dependency and print versions; return a process exit code."""
    problems = []
    versions = {"python": platform.python_version()}
    for module in ("torch", "transformers", "tokenizers", "safetensors", "ray", "vllm"):
        start = time.perf_counter()
        try:
            versions[module] = importlib.import_module(module).__version__
        except Exception as exc:  # report every broken import, not just the first
            problems.append(f"import {module} failed: {type(exc).__name__}: {exc}")
            continue
        versions[module] += f" ({time.perf_counter() - start:.1f}s)"
    try:
        transformers = importlib.import_module("transformers")
        for name in MODEL_CLASSES:
            getattr(transformers, name)
    except Exception as exc:
        problems.append(f"transformers model classes do not load: {type(exc).__name__}: {exc}. "
                        "A torchvision/torchaudio build made for another torch is the usual "
                        "cause: re-run examples/install.sh, or pip uninstall torchvision.")
    if "torch" in versions:
        import torch
        versions["device"] = (f"cuda x{torch.cuda.device_count()} ({torch.cuda.get_device_name(0)})"
                              if torch.cuda.is_available() else "cpu")
    for key, value in versions.items():
        print(f"  {key:13s} {value}")
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    print("environment OK" if not problems else f"{len(problems)} problem(s) found")
    return 1 if problems else 0
