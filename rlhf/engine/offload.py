"""Offload around rollouts: where a role's training state lives in each phase of a step.

A colocated role shares its device with vLLM and with the other roles. The one table below,
`NEEDS`, says which kinds of state each phase computes with; a kind that the phase does not
need lives in host memory when the role's `offload` switch for it is on, and on the device
otherwise. `Offloader.enter(phase)` moves exactly the tensors whose place differs.

    phase        weights  grads  masters  optimizer     who enters it
    idle         -        -      -        -             after every role method returns
    generate     -        -      -        -             ActorWorker.generate (vLLM owns the device)
    sync         device   -      -        -             weight sync into vLLM, HF export
    forward      device   -      -        -             log-prob / value / reference passes
    update       device   device device   device        update_actor, update_critic
    checkpoint   device   -      device   device        save / load a checkpoint

("-": on the host when switched on.) The switches are `<role>.offload.params` (weights),
`.grads`, and `.optimizer` (the fp32 master weights and the AdamW moments: only the step reads
the masters, and they are counted with the optimizer's 12 bytes per parameter).

On CUDA, entering a phase in `RELEASE_BEFORE` (generate, sync: vLLM wakes into the freed
memory) or moving anything to the host first hands PyTorch's cached blocks back to the driver
(`release_cached_memory`), whether or not this role moved anything: the update's activations
stay reserved by PyTorch's caching allocator otherwise, where vLLM's allocator cannot use them.

Each role method under `in_phase` is measured: `Offloader.take_memory_metrics()` returns,
per method called since it was last asked, `memory/<method>/allocated_gb` and `reserved_gb`
(PyTorch's peaks during the call) and `free_gb` (the device's free memory as it ended,
vLLM's share included) on CUDA, `memory/<method>/host_rss_gb` on the CPU; the worst call of
each method, in GB.

Moving a tensor keeps a host copy (pinned on CUDA, allocated once and reused) and replaces its
`.data` by an empty tensor, so the device memory is really released; coming back assigns a
fresh device copy to `.data`, so parameters, optimizer state and hooks keep their identity.
On the CPU the same code runs: host and device are both the CPU, but the tensor really is
emptied and restored, so a step with every switch on computes what it computes with none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from rlhf.config.schema import OffloadConfig
from rlhf.engine.zero import STATE_KINDS
from rlhf.parallel.memory_probes import (memory_now, release_cached_memory, reset_memory_peaks,
                                         worst_memory)

Place = Literal["device", "host"]
StateFn = Callable[[], dict[str, list[Tensor]]]  # TrainEngine.state_tensors

# The kinds each phase computes with (the table of the module docstring). A memory planner
# reads its per-phase peaks from this same table, through `placement`.
NEEDS: dict[str, frozenset[str]] = {
    "idle": frozenset(),
    "generate": frozenset(),
    "sync": frozenset({"weights"}),
    "forward": frozenset({"weights"}),
    "update": frozenset(STATE_KINDS),
    "checkpoint": frozenset({"weights", "masters", "optimizer"}),
}
PHASES = tuple(NEEDS)
# Phases whose work needs the memory other phases left cached: vLLM wakes its weights (sync)
# and its KV cache (generate) through its own allocator.
RELEASE_BEFORE = frozenset({"generate", "sync"})


def offloaded_kinds(config: OffloadConfig) -> frozenset[str]:
    """The kinds of state the switches let leave the device."""
    kinds = {"weights"} if config.params else set()
    if config.grads:
        kinds.add("grads")
    if config.optimizer:
        kinds |= {"masters", "optimizer"}
    return frozenset(kinds)


def placement(phase: str, config: OffloadConfig) -> dict[str, Place]:
    """Where each kind of state lives during `phase`: the table read through the switches."""
    if phase not in NEEDS:
        raise ValueError(f"unknown offload phase {phase!r}; use one of {', '.join(PHASES)}")
    away = offloaded_kinds(config)
    return {kind: "host" if kind in away and kind not in NEEDS[phase] else "device"
            for kind in STATE_KINDS}


class Offloader:
    """Moves one engine's state between its device and host memory, phase by phase.

    `state()` returns the engine's tensors by kind (`TrainEngine.state_tensors`); it is read
    again at every transition, because grads and optimizer moments come and go. The
    constructor enters "idle", so a new role's state leaves the device before vLLM starts.
    """

    def __init__(self, state: StateFn, *, config: OffloadConfig):
        self.state, self.config = state, config
        tensors = [t for items in state().values() for t in items]
        self.device_type = tensors[0].device.type if tensors else "cpu"
        self.phase: str | None = None
        self.memory: dict[str, dict[str, float]] = {}  # method -> worst report, until taken
        self._away: dict[int, tuple[Tensor, Tensor, torch.device]] = {}  # id -> (t, host, device)
        self._host: dict[tuple[str, int], Tensor] = {}  # reusable host buffers
        self.enter("idle")

    def enter(self, phase: str) -> None:
        """Move what `phase` needs onto the device and what it does not need (and may leave) to
        the host; nothing else moves."""
        where = placement(phase, self.config)
        listed: dict[int, Tensor] = {}
        slot: dict[int, str] = {}  # names the reusable host buffer
        host_ok: dict[int, bool] = {}
        for kind, items in self.state().items():
            for index, t in enumerate(items):
                listed[id(t)] = t
                slot.setdefault(id(t), f"{kind}:{index}")
                # A tensor listed under two kinds (an fp32 model is its own master) stays on
                # the device when either kind needs it there.
                host_ok[id(t)] = host_ok.get(id(t), True) and where[kind] == "host"
        to_device = [key for key in listed if not host_ok[key] and key in self._away]
        to_host = [key for key in listed if host_ok[key] and key not in self._away]
        for key in to_device:
            t, host, device = self._away.pop(key)
            t.data = host.to(device, non_blocking=True, copy=True)
        for key in [key for key in self._away if key not in listed]:
            del self._away[key]  # the engine dropped it (a grad set to None) while on the host
        for key in to_host:
            self._to_host(listed[key], slot[key])
        moved = any(listed[key].is_cuda for key in to_host)
        if moved:
            torch.cuda.synchronize()  # the host copies are complete before the blocks go back
        if moved or phase in RELEASE_BEFORE:
            release_cached_memory(self.device_type)
        self.phase = phase

    def measure(self, method: str) -> None:
        """Record the memory of the call of `method` that just ran (the worst call is kept)."""
        seen = self.memory.get(method)
        now = memory_now(self.device_type)
        self.memory[method] = now if seen is None else worst_memory([seen, now])

    def take_memory_metrics(self) -> dict[str, float]:
        """`memory/<method>/<stat>` of the calls measured since the last take; forgets them."""
        out = {f"memory/{method}/{stat}": value for method, report in self.memory.items()
               for stat, value in report.items()}
        self.memory = {}
        return out

    def on_host(self, t: Tensor) -> bool:
        """Whether `t` is currently moved out (its device storage emptied)."""
        return id(t) in self._away

    def _to_host(self, t: Tensor, slot: str) -> None:
        if t._base is not None:  # emptying a view would free nothing: its base keeps the memory
            raise ValueError(f"offload state {slot} is a view of another tensor; "
                             "state_tensors() must list tensors that own their storage")
        host = self._host.get(slot)
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self._host[slot] = host
        host.copy_(t.detach(), non_blocking=True)
        self._away[id(t)] = (t, host, t.device)
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def in_phase(phase: str) -> Callable[[Callable], Callable]:
    """Decorate a role method: `self.offload` enters `phase` before it runs and "idle" after
    it returns (or raises), so between calls the device holds only what the switches keep;
    the call's memory is measured (see the module docstring)."""
    if phase not in NEEDS:
        raise ValueError(f"unknown offload phase {phase!r}; use one of {', '.join(PHASES)}")

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            self.offload.enter(phase)
            reset_memory_peaks(self.offload.device_type)
            try:
                result = method(self, *args, **kwargs)
                self.offload.measure(method.__name__)
                return result
            finally:
                self.offload.enter("idle")
        return run

    return wrap
