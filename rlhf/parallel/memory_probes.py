"""Memory probes of one process: what its device holds and has free, its host RSS, and the one
action between two probes, handing PyTorch's cached device blocks back to the driver.

They live here, below the engine, because the process-group cache measures what each NCCL
communicator takes with them (`rlhf.parallel.mesh`); the offloader, the vLLM sampler and the
driver read them too.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

GB = 2**30  # the metrics' "gb" is GiB


def memory_now(device_type: str) -> dict[str, float]:
    """This process's memory in GB: on CUDA PyTorch's peak allocated and reserved bytes since
    the last `reset_memory_peaks` and the device's free memory; on the CPU the host RSS."""
    if device_type == "cuda":
        return {"allocated_gb": torch.cuda.max_memory_allocated() / GB,
                "reserved_gb": torch.cuda.max_memory_reserved() / GB,
                "free_gb": free_device_bytes(device_type) / GB}
    return {"host_rss_gb": host_rss_bytes() / GB}


def worst_memory(reports: list[dict[str, float]]) -> dict[str, float]:
    """The worst of several memory reports (calls, or ranks): the most used, the least free."""
    keys = {k for report in reports for k in report}
    return {k: (min if k.endswith("free_gb") else max)(r[k] for r in reports if k in r)
            for k in sorted(keys)}


def reset_memory_peaks(device_type: str) -> None:
    """Start a new peak for `memory_now` (CUDA only: the host RSS has no resettable peak)."""
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def free_device_bytes(device_type: str) -> int:
    """Bytes the current CUDA device has free, whoever holds the rest (0 off CUDA)."""
    if device_type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info()
    return int(free)


def device_bytes_taken(run: Callable[[], T], device_type: str) -> tuple[T, int]:
    """`run()`'s result and the device bytes it took outside PyTorch's caching allocator (an
    NCCL communicator's buffers): the drop in free memory less what the allocator reserved
    meanwhile; 0 off CUDA."""
    if device_type != "cuda":
        return run(), 0
    torch.cuda.synchronize()
    free, reserved = free_device_bytes(device_type), torch.cuda.memory_reserved()
    result = run()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - reserved
    return result, max(0, free - free_device_bytes(device_type) - grown)


def release_cached_memory(device_type: str) -> None:
    """Hand the blocks PyTorch's caching allocator keeps reserved back to the driver, so that
    another allocator (vLLM's) or the next phase can use them; a no-op off CUDA."""
    if device_type != "cuda":
        return
    gc.collect()  # tensors that only reference cycles keep alive free their blocks first
    torch.cuda.empty_cache()


def host_rss_bytes() -> int:
    """This process's resident host memory in bytes (the peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux (macOS): the peak RSS, in bytes there
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
