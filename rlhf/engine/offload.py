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

Moving a tensor keeps a host copy and replaces its `.data` by an empty tensor, so the device
memory is really released; coming back assigns a fresh device copy to `.data`, so parameters,
optimizer state and hooks keep their identity. Tensors that were adjacent pieces of one
storage when they left (the dense MLP's paired gate and up weights, `rlhf.models.gate_up`;
an MoE layer's expert stacks, `rlhf.models.moe`) come back as pieces of one fresh allocation at
the same relative offsets, so the pairing and the stacks survive a round trip. The host
copies of one kind of state live in one flat buffer, allocated once at the size `host_layout`
gives (each copy a view starting at a multiple of `HOST_ALIGN`), and on CUDA pinned by
registering exactly those bytes: PyTorch's pinned allocator would round every block up to a
power of two, up to twice what the memory planner counts from the same `host_layout`.
`take_memory_metrics` also reports `memory/pinned_gb` (what this role pinned) and
`timing/pin_s` (seconds spent allocating and pinning its buffers, at start). On the CPU the
same code runs with unpinned buffers: host and device are both the CPU, but the tensor really
is emptied and restored, so a step with every switch on computes what it computes with none.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rlhf.config.schema import OffloadConfig
from rlhf.engine.zero import STATE_KINDS
from rlhf.parallel.memory_probes import (
    GB,
    memory_now,
    release_cached_memory,
    reset_memory_peaks,
    worst_memory,
)
from rlhf.trace import span

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
# Every host copy starts at a multiple of this many bytes: a view of any dtype is aligned and
# copies to and from the device run at full speed.
HOST_ALIGN = 512
# Registering host memory pins whole pages, so a buffer is a whole number of them.
PAGE_BYTES = 4096
# What each role reports once per call of `take_memory_metrics`, beside its methods' memory.
PIN_METRICS = ("memory/pinned_gb", "timing/pin_s")


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


@dataclass(frozen=True)
class HostLayout:
    """Where the host copies of one kind of a role's state sit in its flat buffer."""

    offsets: tuple[int, ...]  # byte offset of each tensor's copy from the buffer's first page
    nbytes: int  # the allocation: copies, alignment padding and one spare page; pinned on CUDA


def host_layout(sizes: Sequence[int]) -> HostLayout:
    """The flat host buffer for tensors of `sizes` bytes: each copy starts at a multiple of
    `HOST_ALIGN` from a page boundary, in whole pages, plus one spare page so the copies can
    start on a page whatever address the allocator returns (an empty list needs no buffer).
    The offloader allocates by it and the memory planner counts pinned memory by it."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-int(size) // HOST_ALIGN) * HOST_ALIGN
    pages = -(-end // PAGE_BYTES) * PAGE_BYTES
    return HostLayout(tuple(offsets), pages + PAGE_BYTES if pages else 0)


def pin_host_memory(buffer: Tensor) -> Callable[[], None]:
    """Page-lock exactly `buffer`'s bytes for the CUDA driver (PyTorch's pinned allocator would
    round them up to a power of two); returns the call that unpins them."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    status = cudart.cudaHostRegister(ptr, nbytes, 0)
    if status != cudart.cudaError.success:
        raise RuntimeError(f"pinning {nbytes / GB:.2f} GB of host memory for offloaded state "
                           f"failed ({status}); offload less (`<role>.offload.*`) or free "
                           "host memory (`rlhf plan` shows the pinned bytes per node)")
    return functools.partial(cudart.cudaHostUnregister, ptr)


@dataclass
class _HostBuffer:
    """One kind's flat host buffer and the view each of its tensors is copied into."""

    signature: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # (shape, dtype) per tensor
    views: list[Tensor]
    nbytes: int
    pinned: bool


def _host_buffer(signature: tuple[tuple[tuple[int, ...], torch.dtype], ...], *,
                 pin: bool) -> _HostBuffer:
    """A flat host buffer laid out by `host_layout` for tensors of these (shape, dtype),
    pinned if `pin`."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in signature]
    layout = host_layout(sizes)
    raw = torch.empty(layout.nbytes, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE_BYTES  # the copies start on a page
    views = [raw[start + offset:start + offset + size].view(dtype).view(shape)
             for offset, size, (shape, dtype) in zip(layout.offsets, sizes, signature)]
    out = _HostBuffer(signature, views, layout.nbytes, pinned=pin and layout.nbytes > 0)
    if out.pinned:
        # The whole allocation, from its first byte: torch's `is_pinned` (and the copies that
        # ask it) look at a view's storage base, which registering from the first page would
        # leave out. Unpinned when the offloader lets the buffer go, before it is freed.
        weakref.finalize(out, pin_host_memory(raw))
    return out


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
        # id -> (move serial, storage address, element offset) of a contiguous tensor as it left
        self._storage: dict[int, tuple[int, int, int]] = {}
        self._moves = 0  # counts `_enter` calls: storage addresses compare within one
        self._buffers: dict[str, _HostBuffer] = {}  # kind -> its host copies
        self.pin_seconds = 0.0  # spent allocating (and pinning) the buffers
        self.enter("idle")

    @property
    def pinned_bytes(self) -> dict[str, int]:
        """Per kind of state, the host bytes this offloader has pinned (none off CUDA)."""
        return {kind: b.nbytes for kind, b in self._buffers.items() if b.pinned}

    def enter(self, phase: str) -> None:
        """Move what `phase` needs onto the device and what it does not need (and may leave) to
        the host; nothing else moves."""
        with span(f"offload:{phase}") as traced:  # None unless the step is traced
            to_device, to_host = self._enter(phase)
            if traced is not None:
                traced.args.update(to_device_bytes=to_device, to_host_bytes=to_host)

    def _enter(self, phase: str) -> tuple[int, int]:
        """Move as `enter` says; returns the bytes moved (to the device, to the host)."""
        where = placement(phase, self.config)
        listed: dict[int, Tensor] = {}
        members: dict[str, list[Tensor]] = {kind: [] for kind in STATE_KINDS}
        slot: dict[int, tuple[str, int]] = {}  # (kind, index): the tensor's host copy
        host_ok: dict[int, bool] = {}
        for kind, items in self.state().items():
            for t in items:
                if id(t) not in listed:  # listed twice: one host copy, in its first kind
                    listed[id(t)] = t
                    slot[id(t)] = (kind, len(members[kind]))
                    members[kind].append(t)
                # A tensor listed under two kinds (an fp32 model is its own master) stays on
                # the device when either kind needs it there.
                host_ok[id(t)] = host_ok.get(id(t), True) and where[kind] == "host"
        to_device = [key for key in listed if not host_ok[key] and key in self._away]
        to_host = [key for key in listed if host_ok[key] and key not in self._away]
        moved_bytes = (sum(_nbytes(self._away[key][1]) for key in to_device),
                       sum(_nbytes(listed[key]) for key in to_host))
        self._to_device(to_device)
        for key in [key for key in self._away if key not in listed]:
            del self._away[key]  # the engine dropped it (a grad set to None) while on the host
            self._storage.pop(key, None)
        self._moves += 1
        for kind in {slot[key][0] for key in to_host}:
            self._ensure_buffer(kind, members[kind])
        for key in to_host:
            self._to_host(listed[key], *slot[key])
        moved = bool(to_host) and self.device_type == "cuda"
        if moved:
            torch.cuda.synchronize()  # the host copies are complete before the blocks go back
        if moved or phase in RELEASE_BEFORE:
            release_cached_memory(self.device_type)
        self.phase = phase
        return moved_bytes

    def measure(self, method: str) -> None:
        """Record the memory of the call of `method` that just ran (the worst call is kept)."""
        seen = self.memory.get(method)
        now = memory_now(self.device_type)
        self.memory[method] = now if seen is None else worst_memory([seen, now])

    def take_memory_metrics(self) -> dict[str, float]:
        """`memory/<method>/<stat>` of the calls measured since the last take (forgotten
        then), and `memory/pinned_gb` and `timing/pin_s` (see the module docstring)."""
        out = {f"memory/{method}/{stat}": value for method, report in self.memory.items()
               for stat, value in report.items()}
        self.memory = {}
        pinned_gb, pin_s = PIN_METRICS
        out[pinned_gb] = sum(self.pinned_bytes.values()) / GB
        out[pin_s] = self.pin_seconds
        return out

    def on_host(self, t: Tensor) -> bool:
        """Whether `t` is currently moved out (its device storage emptied)."""
        return id(t) in self._away

    def _ensure_buffer(self, kind: str, tensors: list[Tensor]) -> None:
        """The kind's flat host buffer, allocated at its first move and again only if the
        kind's tensors changed shape (copies still away keep the old buffer's memory)."""
        for index, t in enumerate(tensors):
            if t._base is not None:  # emptying a view frees nothing: its base keeps the memory
                raise ValueError(f"offload state {kind}:{index} is a view of another tensor; "
                                 "state_tensors() must list tensors that own their storage")
        # a tensor already away is emptied: its host copy has its shape
        signature = tuple((tuple(self._away[id(t)][1].shape if id(t) in self._away else t.shape),
                           t.dtype) for t in tensors)
        held = self._buffers.get(kind)
        if held is None or held.signature != signature:
            start = time.perf_counter()
            self._buffers[kind] = _host_buffer(signature, pin=self.device_type == "cuda")
            self.pin_seconds += time.perf_counter() - start

    def _to_device(self, keys: list[int]) -> None:
        """Fresh device copies of the tensors `keys`; those that shared one storage when they
        left (same move, same address, same dtype) share one allocation again, at the same
        relative offsets."""
        groups: dict[tuple[int, int, torch.dtype] | int, list[int]] = {}
        for key in keys:
            where = self._storage.get(key)
            dtype = self._away[key][0].dtype
            groups.setdefault(key if where is None else (*where[:2], dtype), []).append(key)
        for members in groups.values():
            if len(members) == 1:
                t, host, device = self._away.pop(members[0])
                self._storage.pop(members[0], None)
                t.data = host.to(device, non_blocking=True, copy=True)
                continue
            offsets = [self._storage.pop(key)[2] for key in members]
            moved = [self._away.pop(key) for key in members]
            low = min(offsets)
            high = max(off + host.numel() for off, (_, host, _) in zip(offsets, moved))
            flat = torch.empty(high - low, dtype=moved[0][0].dtype, device=moved[0][2])
            for off, (t, host, _) in zip(offsets, moved):
                piece = flat[off - low:off - low + host.numel()].view(host.shape)
                piece.copy_(host, non_blocking=True)
                t.data = piece

    def _to_host(self, t: Tensor, kind: str, index: int) -> None:
        host = self._buffers[kind].views[index]
        host.copy_(t.detach(), non_blocking=True)
        self._away[id(t)] = (t, host, t.device)
        if t.is_contiguous() and t.numel():
            self._storage[id(t)] = (self._moves, t.untyped_storage().data_ptr(),
                                    int(t.storage_offset()))
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


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
