"""Live-bytes high-water mark of a block of PyTorch code on the CPU: a dispatch-mode tracker
that counts every storage an op creates until the storage is freed."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as m: ...` -> m.peak: the most bytes of storages created inside the
    block that were alive at once (storages made before the block are not counted)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: nothing new (this also keeps
        # storages made before the block, such as the weights, out of the count)
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if id(storage) not in inputs:
                    self._track(storage)
        self.peak = max(self.peak, self.live)
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._seen:
            return
        size = storage.nbytes()
        self._seen.add(key)
        self.live += size
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size
