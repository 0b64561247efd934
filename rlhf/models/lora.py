"""LoRA adapters on the decoder's linear layers: peft's method, names and adapter-file keys.

`apply_lora` turns each targeted projection (an nn.Linear or, after `apply_tp`, a column- or
row-parallel linear) into its LoRA subclass in place: the base weight and bias keep their
objects and names and are frozen, and two factors are added beside them, so our parameter
`model.layers.0.self_attn.q_proj.lora_A.weight` is peft's key with its `base_model.model.`
prefix removed (`peft_key` / `param_name`). The layer computes

    y = base(x) + scaling * lora_B(lora_A(dropout(x))),   scaling = alpha / r  (rslora: / sqrt(r))

Under tensor parallelism the factors follow their base layer, and both read the same input:

    column-parallel base   A (r, in) replicated, B (out/tp, r) split by rows. The adapter adds to
                           this rank's output columns from the gathered (T, H) input (under SP
                           too); A's grad is partial per rank (the engine sums it over TP).
    row-parallel base      A (r, in/tp) split by columns, B (out, r) replicated. The adapter's
                           partial output joins the base's before the one all-reduce (or
                           reduce-scatter under SP); B's grad is partial per rank.

Pipeline stages hold their own layers' adapters and recompute wraps layers with their adapters
inside. The embedding, the LM head (tied or not) and the value head are never adapted; a value
model's head (`score`, fresh for a critic) stays trainable, as peft's `modules_to_save` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlhf.config.schema import LORA_ALL_LINEAR, LoraConfig
from rlhf.errors import ConfigError
from rlhf.models.moe import SparseMoeBlock
from rlhf.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, shard_for_rank

PEFT_PREFIX = "base_model.model."
LORA_FACTORS = ("lora_A", "lora_B")


def lora_scaling(lora: LoraConfig) -> float:
    """The factor on the adapter's output: lora_alpha / r, or lora_alpha / sqrt(r) (rslora)."""
    if not lora.enabled:
        raise ValueError("LoRA is off (r = 0): there is no adapter to scale")
    return lora.lora_alpha / (math.sqrt(lora.r) if lora.use_rslora else lora.r)


class LoraLayer:
    """The adapter half of a LoRA linear, mixed in before the base linear class.

    Subclasses set which factor is split over TP (`_A_SPLIT` / `_B_SPLIT`: the dim, or None
    for replicated) and which one's grad is partial per TP rank (`_PARTIAL`)."""

    _A_SPLIT: int | None = None
    _B_SPLIT: int | None = None
    _PARTIAL: str | None = None
    lora_A: nn.Linear
    lora_B: nn.Linear

    def _add_adapter(self, lora: LoraConfig) -> None:
        tp = getattr(self, "tp_size", 1)
        in_local = self.in_features // (tp if self._A_SPLIT == 1 else 1)
        out_local = self.out_features // (tp if self._B_SPLIT == 0 else 1)
        kw = dict(bias=False, device=self.weight.device, dtype=self.weight.dtype)
        self.lora_A = nn.Linear(in_local, lora.r, **kw)
        self.lora_B = nn.Linear(lora.r, out_local, **kw)
        self.lora_dropout = nn.Dropout(lora.lora_dropout) if lora.lora_dropout else nn.Identity()
        self.scaling = lora_scaling(lora)
        self.adapter_enabled = True
        for param in (self.weight, self.bias):
            if param is not None:
                param.requires_grad_(False)

    def lora_delta(self, x: Tensor) -> Tensor:
        """scaling * B A dropout(x): this rank's share of the adapter's output."""
        return self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def adapter_splits(self) -> dict[str, tuple[int, int]]:
        """{factor parameter: (split dim, full size of that dim)} for the factors split over TP."""
        out = {}
        if self._A_SPLIT is not None:
            out["lora_A.weight"] = (self._A_SPLIT, self.in_features)
        if self._B_SPLIT is not None:
            out["lora_B.weight"] = (self._B_SPLIT, self.out_features)
        return out

    def adapter_partial_grads(self) -> tuple[str, ...]:
        """The replicated factor whose grad each TP rank holds only part of (tp > 1)."""
        return (f"{self._PARTIAL}.weight",) if self._PARTIAL else ()

    @torch.no_grad()
    def init_adapter_(self, generator: torch.Generator) -> None:
        """peft's init: A kaiming-uniform (a = sqrt(5)) over the full (r, in), B zeros; each rank
        keeps its slice of the same full A, drawn on the CPU from `generator`."""
        full_A = torch.empty(self.lora_A.out_features, self.in_features)
        # kaiming_uniform_(a=sqrt(5)) is uniform(+-1/sqrt(fan_in)); drawn with our generator
        # so every rank and layout gets the same A.
        bound = 1.0 / math.sqrt(self.in_features)
        full_A.uniform_(-bound, bound, generator=generator)
        if self._A_SPLIT is not None:
            full_A = shard_for_rank(full_A, self._A_SPLIT, self.tp_rank, self.tp_size)
        self.lora_A.weight.copy_(full_A)
        self.lora_B.weight.zero_()


class LoraLinear(LoraLayer, nn.Linear):
    """An unsharded nn.Linear with an adapter."""

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_delta(x) if self.adapter_enabled else out


class LoraColumnParallelLinear(LoraLayer, ColumnParallelLinear):
    """A column-parallel linear with an adapter: A replicated, B split like the base's rows."""

    _B_SPLIT, _PARTIAL = 0, "lora_A"

    def local_linear(self, x_TH: Tensor) -> Tensor:
        out = super().local_linear(x_TH)
        return out + self.lora_delta(x_TH) if self.adapter_enabled else out


class LoraRowParallelLinear(LoraLayer, RowParallelLinear):
    """A row-parallel linear with an adapter: A split like the base's columns, B replicated."""

    _A_SPLIT, _PARTIAL = 1, "lora_B"

    def local_linear(self, x_TI: Tensor) -> Tensor:
        partial = super().local_linear(x_TI)
        return partial + self.lora_delta(x_TI) if self.adapter_enabled else partial


_LORA_CLASS = {nn.Linear: LoraLinear, ColumnParallelLinear: LoraColumnParallelLinear,
               RowParallelLinear: LoraRowParallelLinear}


def target_names(model: nn.Module, lora: LoraConfig) -> list[str]:
    """Qualified names of the modules `lora.target_modules` selects in `model` (peft's rule:
    the last name component matches); a ConfigError names the model's linear layers when a
    listed name matches none. A mixture-of-experts block's routed experts are never adapted:
    the block reads their weights directly, so an adapter there would train nothing."""
    wanted = set(lora.modules)
    experts = {id(m) for block in model.modules() if isinstance(block, SparseMoeBlock)
               for m in block.experts.modules()}
    found, names = set(), []
    for qualified, module in model.named_modules():
        leaf = qualified.rsplit(".", 1)[-1]
        if leaf in wanted and type(module) in _LORA_CLASS and id(module) not in experts:
            names.append(qualified)
            found.add(leaf)
    missing = sorted(wanted - found)
    if missing and LORA_ALL_LINEAR not in lora.target_modules:
        have = sorted({q.rsplit(".", 1)[-1] for q, m in model.named_modules()
                       if type(m) in _LORA_CLASS and id(m) not in experts})
        raise ConfigError(f"lora.target_modules {missing} match no linear layer of this model; "
                          f"its linear layers are {have}")
    return names


def apply_lora(model: nn.Module, lora: LoraConfig, *, seed: int = 0) -> list[str]:
    """Add adapters to `model` in place (after `apply_tp`, before recompute) and freeze every
    other parameter but a value head; returns the adapted module names. Factors on the meta
    device stay uninitialised (call `init_lora_` once materialised); others are initialised
    from `seed`."""
    if not lora.enabled:
        raise ValueError("LoRA is off (r = 0); check lora.enabled before applying it")
    if has_lora(model):
        raise ValueError("this model already has adapters; apply LoRA once")
    names = target_names(model, lora)
    for param in model.parameters():
        param.requires_grad_(False)
    score = getattr(model, "score", None)
    if score is not None:  # a value model's head is new: it trains (peft's modules_to_save)
        score.requires_grad_(True)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        # Swapping the class keeps the base parameters' objects, names and loaded values.
        module.__class__ = _LORA_CLASS[type(module)]
        module._add_adapter(lora)
    if not any(p.is_meta for p in model.parameters()):
        init_lora_(model, seed=seed)
    return names


def init_lora_(model: nn.Module, *, seed: int = 0) -> None:
    """(Re)initialise every adapter as peft does; the values depend on `seed` and the module's
    name only, so every TP / PP layout holds slices of the same full adapter."""
    for name, module in lora_modules(model):
        generator = torch.Generator().manual_seed(_name_seed(seed, name))
        module.init_adapter_(generator)


def _name_seed(seed: int, name: str) -> int:
    # Recompute wrappers insert "inner." into names; the seed must not depend on them.
    key = name.replace(".inner.", ".")
    value = seed
    for byte in key.encode():
        value = (value * 131 + byte) % (1 << 61)
    return value


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraLayer]]:
    """(qualified name, module) of every adapted layer of `model`."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def has_lora(model: nn.Module) -> bool:
    """Whether `model` carries adapters."""
    return next(lora_modules(model), None) is not None


@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Run `model` as its frozen base (the adapters skipped), e.g. for reference log-probs."""
    layers = [m for _, m in lora_modules(model)]
    before = [m.adapter_enabled for m in layers]
    for m in layers:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m, state in zip(layers, before):
            m.adapter_enabled = state


# ---- names and files --------------------------------------------------------------------------

def is_lora_param(name: str) -> bool:
    """Whether a parameter name (ours or a peft key) is a LoRA factor."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in LORA_FACTORS


def peft_key(name: str) -> str:
    """Our parameter name -> its key in a peft adapter file (and back with `param_name`)."""
    if not is_lora_param(name):
        raise ValueError(f"{name} is not a LoRA factor (…lora_A.weight / …lora_B.weight)")
    return PEFT_PREFIX + name


def param_name(key: str) -> str:
    """A peft adapter-file key -> our parameter name (the inverse of `peft_key`)."""
    if not key.startswith(PEFT_PREFIX) or not is_lora_param(key):
        raise ValueError(f"{key} is not a peft LoRA key ({PEFT_PREFIX}….lora_A.weight)")
    return key[len(PEFT_PREFIX):]


def adapter_state(named: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor]
                  ) -> dict[str, Tensor]:
    """The LoRA factors among full (unsharded) tensors named as our parameters, keyed as in a
    peft `adapter_model.safetensors`; other tensors are left out."""
    items = named.items() if isinstance(named, Mapping) else named
    return {peft_key(name): tensor for name, tensor in items if is_lora_param(name)}


def merged_weights(full: Mapping[str, Tensor], *, lora: LoraConfig) -> dict[str, Tensor]:
    """Full base tensors (our names) with each adapter folded in, W + scaling * B @ A, in fp32
    then cast back; the factors themselves are left out: a plain Hugging Face state."""
    scaling = lora_scaling(lora)
    out = {}
    for name, tensor in full.items():
        if is_lora_param(name):
            continue
        prefix = name[: -len("weight")] if name.endswith(".weight") else None
        a, b = (full.get(f"{prefix}lora_A.weight"), full.get(f"{prefix}lora_B.weight")) \
            if prefix else (None, None)
        if a is not None and b is not None:
            tensor = (tensor.float() + scaling * (b.float() @ a.float())).to(tensor.dtype)
        out[name] = tensor
    return out


def peft_config(lora: LoraConfig, *, base_model: str = "") -> dict:
    """The `adapter_config.json` peft writes for these settings (PeftModel.from_pretrained and
    vLLM read it)."""
    targets = list(lora.modules)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.r, "lora_alpha": lora.lora_alpha, "lora_dropout": lora.lora_dropout,
            "target_modules": targets, "use_rslora": lora.use_rslora, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
            "init_lora_weights": True}
