"""A peft adapter folder: `adapter_config.json` and `adapter_model.safetensors`, the form
`peft.PeftModel.from_pretrained(base, folder)` and vLLM's `LoRARequest` load.

`rlhf export-hf` writes one for a LoRA policy (the factors gathered from any layout, under
peft's keys: `rlhf.models.lora.peft_key`), beside the tokenizer files of the base; the
config comes from `rlhf.models.lora.peft_config`, so the folder and the adapters the
engine trains agree on rank, scaling and targets. `read_adapter_folder` reads one back under
our parameter names; `merged_stream` folds the adapters into the base weights as the export
streams them (`rlhf export-hf --merge`, and a LoRA run's final `hf_model`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from rlhf.config.schema import LoraConfig
from rlhf.errors import RLHFError
from rlhf.models.lora import is_lora_param, merged_weights, param_name, peft_config, peft_key

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def write_adapter_folder(folder: str | Path, factors: Iterable[tuple[str, Tensor]], *,
                         lora: LoraConfig, base_model: str) -> Path:
    """`factors` (full LoRA factors under our parameter names) as a peft adapter of
    `base_model` (its path or hub name, recorded in the config) in `folder`."""
    folder = Path(folder)
    tensors = {}
    for name, tensor in factors:
        if not is_lora_param(name):
            raise ValueError(f"{name} is not a LoRA factor; pass the adapter's factors only")
        tensors[peft_key(name)] = tensor.detach().contiguous().cpu()
    if not tensors:
        raise ValueError("no LoRA factors to write; is actor.lora.r > 0 in this run?")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = peft_config(lora, base_model=base_model)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def read_adapter_folder(folder: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(adapter_config.json, factors under our parameter names) of a peft LoRA folder."""
    folder = Path(folder)
    config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise RLHFError(f"{folder} is not a peft adapter folder: it needs {ADAPTER_CONFIG} "
                        f"and {ADAPTER_WEIGHTS}")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if config.get("peft_type") != "LORA":
        raise RLHFError(f"{config_file} holds a {config.get('peft_type')} adapter; only LORA "
                        "adapters are read")
    return config, {param_name(key): t for key, t in load_file(weights_file).items()}


def lora_from_peft(config: dict) -> LoraConfig:
    """The LoraConfig an adapter_config.json describes (rank, alpha, targets, rslora)."""
    return LoraConfig(r=int(config["r"]), lora_alpha=float(config["lora_alpha"]),
                      lora_dropout=float(config.get("lora_dropout") or 0.0),
                      target_modules=tuple(config["target_modules"]),
                      use_rslora=bool(config.get("use_rslora", False)))


def merged_stream(buckets: Iterable[list[tuple[str, Tensor]]], *,
                  lora: LoraConfig) -> Iterator[list[tuple[str, Tensor]]]:
    """Buckets of full tensors (base and factors, our names) -> buckets of a plain Hugging Face
    state with each adapter folded into its weight (`rlhf.models.lora.merged_weights`). A
    targeted weight waits for its two factors, which the export sends right after it (a
    module's parameters are consecutive), so only a few tensors are held across buckets."""
    pending: dict[str, dict[str, Tensor]] = {}  # module -> its weight and factors so far
    for bucket in buckets:
        out = []
        for name, tensor in bucket:
            module = _adapted_module(name, lora)
            if module is None:
                out.append((name, tensor))
                continue
            group = pending.setdefault(module, {})
            group[name] = tensor
            if len(group) == 3:  # weight, lora_A, lora_B
                out.extend(merged_weights(pending.pop(module), lora=lora).items())
        if out:
            yield out
    if pending:
        raise RLHFError(f"the export ended with {len(pending)} adapted weight(s) missing a "
                        f"factor or the weight itself: {sorted(pending)[:4]}")


def _adapted_module(name: str, lora: LoraConfig) -> str | None:
    """The module whose merge needs this tensor (its weight or a factor), else None."""
    if is_lora_param(name):
        return name.rsplit(".", 2)[0]
    module, _, leaf = name.rpartition(".")
    if leaf == "weight" and module.rpartition(".")[2] in lora.modules:
        return module
    return None
