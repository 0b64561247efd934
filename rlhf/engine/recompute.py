"""Activation recomputation: modules wrapped so backward recomputes their activations.

`apply_recompute` wraps, in every decoder layer, the part the mode names in `Recomputed`:
"full" the whole layer (only its input is kept), "attention_block" the attention block
(projections, RoPE and core attention; Megatron's "selective" recomputes core attention
only). The wrapper shows in the module tree; its state-dict keys are the wrapped module's, so
checkpoints and HF names are the same with or without recomputation.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlhf.config.schema import RECOMPUTE_MODES, Recompute

RENAMED = {"selective": "attention_block"}


class Recomputed(nn.Module):
    """`inner` under activation checkpointing while grads are on: its activations are
    recomputed in backward instead of kept. State-dict keys are `inner`'s own."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.register_state_dict_post_hook(_drop_inner_prefix)
        self.register_load_state_dict_pre_hook(_add_inner_prefix)

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.inner(*args)
        return checkpoint(self.inner, *args, use_reentrant=False)


def apply_recompute(model: nn.Module, mode: Recompute) -> None:
    """Wrap every decoder layer of `model` ("full") or its attention block ("attention_block")
    in `Recomputed`; "none" leaves the model as it is."""
    if mode in RENAMED:
        raise ValueError(f"recompute {mode!r} is now {RENAMED[mode]!r} (it recomputes the whole "
                         f"attention block); pass {RENAMED[mode]!r}")
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    if mode == "none":
        return
    layers = model.model.layers
    for name, layer in layers.items():
        if mode == "full":
            layers[name] = Recomputed(layer)
        else:
            layer.self_attn = Recomputed(layer.self_attn)


def _drop_inner_prefix(module, state_dict, prefix, local_metadata) -> None:
    inner = f"{prefix}inner."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_inner_prefix(module, state_dict, prefix, local_metadata, strict, missing_keys,
                      unexpected_keys, error_msgs) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and
                not k.startswith(f"{prefix}inner.")]:
        state_dict[f"{prefix}inner.{key[len(prefix):]}"] = state_dict.pop(key)
