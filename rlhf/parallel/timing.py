"""Timing work that a device runs asynchronously.

On CUDA, kernels and NCCL collectives return to the host as soon as they are queued, so a host
clock around them measures the launch, not the work. `Stopwatch` records CUDA events on the
current stream around each timed block instead and reads them back only when `seconds` is
asked (one wait, at the end of a phase); elsewhere it uses the host clock, which is exact there.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class Stopwatch:
    """Total seconds of the `with watch():` blocks, as the device's stream saw them."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host_s = 0.0

    @contextmanager
    def __call__(self):
        if self.cuda:
            start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            try:
                yield
            finally:
                stop.record()
                self._events.append((start, stop))
            return
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._host_s += time.perf_counter() - begin

    @property
    def seconds(self) -> float:
        """The total so far; on CUDA this waits for the last timed block to finish."""
        if not self._events:
            return self._host_s
        self._events[-1][1].synchronize()
        return self._host_s + sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
