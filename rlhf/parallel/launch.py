"""Run a function on N local processes with torch.distributed initialised; collect the results.

The launcher edge for tests/dist and `rlhf verify-model`: it alone picks an address and a port,
and passes them to `init_process_group(init_method="tcp://...")` (no environment variables).
A rank that raises, dies or hangs makes the caller fail promptly with that rank named.
"""

from __future__ import annotations

import datetime
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf.parallel.mesh import init_world

_POLL_S = 0.5  # how often the caller re-checks the deadline while nothing happens
_PEER_GRACE_S = 2.0  # how long to wait for the cause once a rank reports a lost peer
# How ranks start: a fresh interpreter each ("spawn") unless `fork_ranks_from_a_server` chose
# otherwise.
_start_method = "spawn"


class DistributedRunError(RuntimeError):
    """A rank raised, died or did not finish; `rank` names it, `remote_traceback` has its trace."""

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class DistributedTimeoutError(DistributedRunError, TimeoutError):
    """Some ranks had not returned when `timeout_s` ran out; all ranks were killed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fork_ranks_from_a_server(preload: list[str]) -> None:
    """Later launches fork their ranks from one server process that imports `preload` once,
    instead of a fresh interpreter per rank re-importing torch (seconds of CPU each). For
    callers making many short launches (the test suite); ranks see the environment of the
    first such launch."""
    global _start_method
    mp.set_forkserver_preload(preload)
    _start_method = "forkserver"


def run_distributed(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    timeout_s: float = 60.0,
    backend: str = "gloo",
    collective_timeout_s: float | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `nproc` spawned processes; return their results by rank.

    `fn` and `args` must be picklable (a module-level function) and so must the results.
    Collectives in the children time out after `collective_timeout_s` (default `timeout_s`).
    With backend "nccl" rank r runs on local GPU r (modulo the visible GPUs), set current
    before the process group starts.
    Raises DistributedRunError naming the rank (with its traceback) if a rank raises or dies,
    and DistributedTimeoutError if the ranks have not all returned within `timeout_s`.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    try:
        # Pickled here, unpickled inside the child's error handling: an import failure there
        # (fn's module not importable in a fresh process) comes back as a traceback.
        job = pickle.dumps((fn, args))
    except Exception as e:
        raise ValueError(f"fn and args must be picklable (fn a module-level function): {e}") from e
    pg_timeout_s = collective_timeout_s if collective_timeout_s is not None else timeout_s
    for attempt in range(1, _PORT_TRIES + 1):
        try:
            return _launch(job, nproc, f"tcp://127.0.0.1:{free_port()}", backend=backend,
                           timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
        except DistributedRunError as e:
            if attempt == _PORT_TRIES or not port_was_taken(e.remote_traceback):
                raise
    raise AssertionError("unreachable")


# free_port's port is free when it returns, but another process (a Ray worker's outgoing
# connection, another launch) may bind it before rank 0 does: such a launch is retried on a
# new port, at most this many times in all. Nothing of `fn` has run then.
_PORT_TRIES = 3


def port_was_taken(remote_traceback: str) -> bool:
    """Whether a launch failed because its rendezvous port was taken before rank 0 bound it:
    while the ranks joined the process group, before any of them ran the job."""
    return "EADDRINUSE" in remote_traceback and "in init_world" in remote_traceback


def _launch(job: bytes, nproc: int, init_method: str, *, backend: str, timeout_s: float,
            pg_timeout_s: float) -> list[Any]:
    ctx = mp.get_context(_start_method)
    procs, conns = [], []
    try:
        for rank in range(nproc):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(job, rank, nproc, init_method, backend, pg_timeout_s, writer),
                name=f"rank{rank}",
            )
            proc.start()
            writer.close()  # the child holds the only writer, so its death reads as EOF here
            procs.append(proc)
            conns.append(reader)
        return _collect(procs, conns, deadline=time.monotonic() + timeout_s, timeout_s=timeout_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)
        for conn in conns:
            conn.close()


def _child(job, rank, world_size, init_method, backend, pg_timeout_s, conn: Connection):
    torch.set_num_threads(1)  # ranks share a few cores
    try:
        device = torch.device("cpu")
        if backend == "nccl":  # one GPU per rank, current before NCCL binds to it
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        fn, args = pickle.loads(job)
        init_world(backend, init_method=init_method, rank=rank, world_size=world_size,
                   timeout=datetime.timedelta(seconds=pg_timeout_s), device=device)
        result = fn(rank, world_size, *args)
        dist.barrier()  # rank 0 hosts the store: nobody tears down while others still use it
    except BaseException:
        # Report before any teardown: closing our sockets would make peers fail with a
        # secondary error that could reach the caller first.
        _send(conn, ("error", traceback.format_exc()))
        conn.close()
        return
    try:
        payload = pickle.dumps(("ok", result))
    except Exception:
        payload = pickle.dumps(("error", f"the result is not picklable:\n{traceback.format_exc()}"))
    conn.send_bytes(payload)  # plain pickle: tensors travel by value, not via shared memory
    conn.close()
    dist.destroy_process_group()


def _send(conn: Connection, message: tuple[str, str]) -> None:
    try:
        conn.send_bytes(pickle.dumps(message))
    except OSError:
        pass  # the caller is gone or has killed us; nobody to tell


def _collect(procs, conns, *, deadline: float, timeout_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    while len(results) < len(procs) and not errors:
        pending = [r for r in range(len(procs)) if r not in results]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedTimeoutError(
                f"ranks {pending} of {len(procs)} did not finish within {timeout_s:g} s "
                "(a hang or a deadlocked collective); all ranks were killed",
                rank=pending[0],
            )
        wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending],
             timeout=min(remaining, _POLL_S))
        for r in pending:
            _poll_rank(r, procs[r], conns[r], results, errors)
    if errors:
        _drain_errors(procs, conns, results, errors)
        # A rank whose peer died fails too, often in the same instant: name the cause first.
        order = sorted(errors, key=lambda r: (_is_peer_loss(errors[r]), r))
        first = order[0]
        detail = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in order)
        raise DistributedRunError(
            f"rank {first} failed ({len(errors)} of {len(procs)} ranks failed):\n{detail}",
            rank=first,
            remote_traceback=errors[first],
        )
    return [results[r] for r in range(len(procs))]


_PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _is_peer_loss(error: str) -> bool:
    """Whether a rank's error only says that another rank went away."""
    return any(words in error for words in _PEER_LOSS)


def _poll_rank(rank, proc, conn, results, errors) -> None:
    """Take rank's message if one arrived; record an error if it died without sending one."""
    alive = proc.is_alive()  # read before polling: a message sent before death is then visible
    if conn.poll():
        try:
            status, payload = pickle.loads(conn.recv_bytes())
        except EOFError:
            errors[rank] = _death_message(proc)
            return
        (results if status == "ok" else errors)[rank] = payload
    elif not alive:
        errors[rank] = _death_message(proc)


def _drain_errors(procs, conns, results, errors) -> None:
    """Collect errors that other ranks report at about the same time.

    If every error so far only says that a peer went away, wait briefly for the cause: the dead
    peer's process may not be reaped yet when the survivors' reports arrive.
    """
    deadline = time.monotonic() + _PEER_GRACE_S
    while True:
        pending = [r for r in range(len(procs)) if r not in results and r not in errors]
        for r in pending:
            _poll_rank(r, procs[r], conns[r], results, errors)
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not pending or not all(map(_is_peer_loss, errors.values())):
            return
        wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending],
             timeout=min(remaining, 0.1))


def _death_message(proc) -> str:
    proc.join(timeout=1)
    code = proc.exitcode
    if code is not None and code < 0:
        return f"the process was killed by signal {-code} before returning a result"
    return f"the process exited with code {code} before returning a result"
