"""The mechanism of regional `torch.compile` (`rlhf.models.fused` says what is fused and why):
a body with an eager and a compiled form, and the `compile` setting's meaning per device.
Here, below the models, so that the vocab head (`vocab_parallel`) can fuse its chunks too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhf.config.schema import COMPILE_CHOICES, Compile


def compile_enabled(setting: Compile, device: torch.device | str) -> bool:
    """Whether `setting` compiles on `device`: auto = on CUDA only (see the module doc)."""
    if setting not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {setting!r}")
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "on"


class Fused:
    """One elementwise body: `self(fused, *args)` runs the compiled form when `fused`, else
    the eager one; compiled lazily, once per process (torch.compile caches the graphs)."""

    def __init__(self, fn: Callable[..., Any]):
        self.eager = fn
        self.__name__ = getattr(fn, "__name__", "fused")
        self._compiled: Callable[..., Any] | None = None

    @property
    def compiled(self) -> Callable[..., Any]:
        if self._compiled is None:
            self._compiled = torch.compile(self.eager, dynamic=True, fullgraph=True)
        return self._compiled

    def __call__(self, fused: bool, *args):
        return (self.compiled if fused else self.eager)(*args)
