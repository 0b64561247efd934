"""Copies from host memory to a device that do not make the host wait."""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """`tensor` on `device`. A CPU tensor bound for CUDA goes through pinned memory with
    `non_blocking=True`: a copy from pageable memory synchronises the stream, once per tensor
    (the caching host allocator keeps the pinned copy alive until the transfer is done)."""
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
