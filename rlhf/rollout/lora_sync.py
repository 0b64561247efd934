"""Adapter-only weight sync into vLLM (actor.lora): the engine loads the base once, from
model.path, and receives only the LoRA factors after each update.

vLLM's public API loads an adapter from a folder (`LoRARequest.lora_path`). The engine runs in
this process, so the sync skips the folder: `add_adapter` runs inside vLLM's worker (through
`collective_rpc`, on every rank of a replica), builds vLLM's LoRA model from the full tensors
with vLLM's own loader (`LoRAModel.from_lora_tensors`: peft keys, q/k/v and gate/up packing,
TP slicing at activation) and registers it in the worker's adapter cache under a new integer
id. A request that names that id finds the adapter registered and never reads the path, as
vLLM's own warm-up adapters do.

Each sync is a new version with a new id; `AdapterVersions` keeps the newest
`ADAPTER_VERSIONS` registered (a batch still sampling with the previous version keeps it) and
unloads older ones. `check_lora_internals` checks the internals this uses when the engine is
built, as rlhf.rollout.compat does for the full sync. `add_adapter` refuses an adapter that
leaves any adapted vLLM module without both factors or names a module vLLM does not have: vLLM
would quietly serve the base there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor

from rlhf.config.schema import LoraConfig
from rlhf.errors import ConfigError
from rlhf.rollout.compat import TESTED_VLLM, VLLMVersionError, installed_vllm_version
from rlhf.rollout.weights import IncompleteSyncError

ADAPTER_VERSIONS = 2  # adapters registered at once: the newest and the one before it
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
# vLLM checks that a LoRARequest names a path; registered adapters are never read from it.
IN_MEMORY_PATH = "/in-memory-adapter"


def max_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank `r`."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ConfigError(f"actor.lora.r={r} is above vLLM's largest max_lora_rank "
                      f"{VLLM_LORA_RANKS[-1]}; use a rank of at most {VLLM_LORA_RANKS[-1]}")


def lora_engine_args(lora: LoraConfig) -> dict:
    """vLLM `LLM` keyword arguments of an engine that serves the adapter versions."""
    return dict(enable_lora=True, max_lora_rank=max_lora_rank(lora.r),
                max_loras=ADAPTER_VERSIONS, max_cpu_loras=ADAPTER_VERSIONS)


def check_lora_internals(llm) -> None:
    """VLLMVersionError naming what `add_adapter` needs and the installed vLLM lacks: its
    adapter loader, and on every worker the adapter cache it registers into."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    problems = [name for name, owner, attr in (
        ("LoRAModel.from_lora_tensors", LoRAModel, "from_lora_tensors"),
        ("PEFTHelper.from_dict", PEFTHelper, "from_dict")) if not hasattr(owner, attr)]
    if not all(llm.collective_rpc(_has_adapter_cache)):
        problems.append("worker.model_runner.lora_manager._adapter_manager")
    if problems:
        raise VLLMVersionError(
            f"vLLM {installed_vllm_version()} lacks {', '.join(problems)}, which the adapter "
            f"sync (actor.lora) calls; install a vLLM in the tested range {TESTED_VLLM}")


def _has_adapter_cache(worker) -> bool:
    # Runs inside each vLLM worker: the attribute chain `add_adapter` uses.
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    cache = getattr(manager, "_adapter_manager", None)
    return all(hasattr(cache, a) for a in ("add_adapter", "modules", "packed_modules_mapping"))


def add_adapter(worker, tensors: dict[str, Tensor], config: dict, lora_id: int) -> int:
    """Register full adapter `tensors` (peft keys) with peft `config` as vLLM adapter `lora_id`
    in this worker (a `collective_rpc` target); returns how many modules it adapts."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    cache = manager._adapter_manager
    mapper = getattr(cache.model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None)
    _check_covers(lora, expected=_expected_modules(cache, config["target_modules"]))
    cache.add_adapter(lora)  # before the packing, which merges q/k/v into qkv_proj in place
    return len(lora.loras)


def _expected_modules(cache, targets: Iterable[str]) -> set[str]:
    """vLLM's names of the unpacked modules an adapter on `targets` must cover: every LoRA
    layer of the model whose own or packed sub-module names are in `targets`."""
    targets = set(targets)
    packed = cache.packed_modules_mapping
    expected = set()
    for name in cache.modules:
        prefix, _, leaf = name.rpartition(".")
        for sub in packed.get(leaf, [leaf]):
            if sub in targets:
                expected.add(f"{prefix}.{sub}" if prefix else sub)
    return expected


def _check_covers(lora, *, expected: set[str]) -> None:
    got = {name for name, w in lora.loras.items() if w.lora_a is not None and w.lora_b is not None}
    missing, unknown = sorted(expected - got), sorted(set(lora.loras) - expected)
    if not missing and not unknown:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} adapted module(s) without both factors: {missing[:4]}")
    if unknown:
        parts.append(f"{len(unknown)} module(s) vLLM does not adapt: {unknown[:4]}")
    raise IncompleteSyncError(
        f"the adapter sync left vLLM's adapter incomplete ({'; '.join(parts)}); vLLM would serve "
        "the base weights there. The actor must send every factor once, under peft's keys "
        "(rlhf.models.lora.peft_key), for the modules of actor.lora.target_modules")


@dataclass(frozen=True)
class AdapterVersion:
    """One adapter registered in the engine: its vLLM id and the request that selects it."""

    lora_id: int
    request: object  # vllm.lora.request.LoRARequest


class AdapterVersions:
    """The adapter versions one vLLM engine holds (see the module docstring)."""

    def __init__(self, config: dict):
        self.config = config  # peft's adapter_config.json of actor.lora
        self.loaded: list[AdapterVersion] = []
        self.next_id = 1

    @property
    def current(self):
        """The LoRARequest of the newest version; None before the first sync (the policy is
        still model.path, which an adapter initialised as peft does leaves unchanged)."""
        return self.loaded[-1].request if self.loaded else None

    def load(self, llm, tensors: dict[str, Tensor]) -> int:
        """Register `tensors` as a new version on every rank of the engine and make it current;
        the oldest is unloaded first when ADAPTER_VERSIONS are held. Returns the modules adapted."""
        from vllm.lora.request import LoRARequest

        while len(self.loaded) >= ADAPTER_VERSIONS:  # room first: vLLM's cache is that big
            llm.llm_engine.remove_lora(self.loaded.pop(0).lora_id)
        lora_id = self.next_id
        self.next_id += 1
        counts = llm.collective_rpc(add_adapter, args=(tensors, self.config, lora_id))
        request = LoRARequest(lora_name=f"policy-{lora_id}", lora_int_id=lora_id,
                              lora_path=IN_MEMORY_PATH)
        self.loaded.append(AdapterVersion(lora_id, request))
        return int(counts[0])
