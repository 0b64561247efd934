"""Spawned worker processes that run reward functions over chunks of samples, with timeouts.

Design: the driver sends each idle worker a chunk of samples in one message; the worker calls
every function on every sample of the chunk and streams back one small message per call
(no round trip: it never waits for the driver). The driver therefore knows which call a
worker is in and when it started (the previous message), and enforces the timeout itself:
a worker silent for timeout_s is killed (SIGKILL works on a call stuck in C code, where an
in-worker alarm would not), the call counts as timed out, a fresh worker is spawned and the
rest of the chunk is queued again.

Workers are fresh interpreters (`python -c`, a socket pair as the pipe) rather than
multiprocessing children: fork is unsafe next to Ray and torch threads, and spawn re-runs the
driver's main script, which breaks drivers without an `if __name__ == "__main__"` guard.
"""

import math
import os
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, wait

from rlhf.errors import RLHFError
from rlhf.rewards.worker import Outcome

# Seconds a new worker may take to import its reward functions.
STARTUP_TIMEOUT_S = 120.0
# Chunks per worker and batch: enough to balance uneven call times, few enough to batch IPC.
CHUNKS_PER_WORKER = 4
_JOIN_S = 2.0
# The driver's sys.path goes first, so workers import user modules (and rlhf) as it does.
_WORKER_CODE = "import sys; sys.path[:] = {path!r}; from {module} import main; main()"


def spawn_child(module: str) -> tuple[subprocess.Popen, Connection]:
    """A fresh interpreter running `module.main()` (see rlhf.rewards.worker.child_main) and
    our end of its socket pair; a dead child reads as EOF on it."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE.format(path=[str(p) for p in sys.path],
                                                       module=module),
             str(theirs.fileno()), str(os.getpid())], pass_fds=[theirs.fileno()],
            start_new_session=True)  # Ctrl-C reaches the driver, which stops the workers
        return proc, Connection(ours.detach())


class _Worker:
    """One process, its pipe, and the calls it still owes (sample, function) in order."""

    def __init__(self, loads: list[tuple[str, str]]):
        self.proc, self.conn = spawn_child("rlhf.rewards.worker")
        self.conn.send(loads)
        self.ready = False
        self.owed: deque[tuple[int, int]] = deque()
        self.task_items: list = []  # (index, sample) pairs of the current chunk, by index
        self.since = time.monotonic()  # start of the current call, or of the spawn

    def send_task(self, items: list, first_function: int, num_functions: int) -> None:
        self.owed = deque((index, f) for pos, (index, _) in enumerate(items)
                          for f in range(first_function if pos == 0 else 0, num_functions))
        self.task_items = items
        self.since = time.monotonic()
        self.conn.send((items, first_function))

    def remaining_task(self, num_functions: int) -> tuple[list, int] | None:
        """The chunk's calls after the one now owed, as a task for another worker."""
        index, f = self.owed[0]
        rest = [item for item in self.task_items if item[0] > index or
                (item[0] == index and f + 1 < num_functions)]
        if not rest:
            return None
        return rest, (f + 1 if rest[0][0] == index else 0)

    def kill(self) -> None:
        self.proc.kill()
        reap(self.proc)
        self.conn.close()


class RewardProcesses:
    """num_workers spawned processes running the functions of `loads`, (spec, convention)
    pairs (see rlhf.rewards.loader.load_reward_function); see the module docstring."""

    def __init__(self, loads: Sequence[tuple[str, str]], *, num_workers: int, timeout_s: float):
        self._loads, self._timeout_s = list(loads), timeout_s
        self._specs = [spec for spec, _ in self._loads]
        self._workers: list[_Worker] = [_Worker(self._loads) for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def run(self, samples: list[dict]) -> Iterator[tuple[int, int, Outcome]]:
        """(index, function, outcome) for every call, in completion order.

        Closing the iterator early (the caller raises) kills workers still busy with this batch.
        """
        nf = len(self._specs)
        size = max(1, math.ceil(len(samples) / (len(self._workers) * CHUNKS_PER_WORKER)))
        items = list(enumerate(samples))
        queue = deque((items[i:i + size], 0) for i in range(0, len(items), size))
        left = len(samples) * nf
        try:
            while left:
                self._dispatch(queue)
                ready = wait([w.conn for w in self._workers if not w.ready or w.owed],
                             timeout=self._seconds_to_next_deadline())
                for worker in list(self._workers):
                    if worker.conn in ready:
                        for result in self._drain(worker, queue):
                            left -= 1
                            yield result
                for worker in list(self._workers):
                    result = self._check_deadline(worker, queue)
                    if result is not None:
                        left -= 1
                        yield result
        finally:
            if left:  # abandoned batch: its half-done chunks must not leak into the next one
                for worker in list(self._workers):
                    if worker.owed:
                        self._replace(worker)

    def _dispatch(self, queue: deque) -> None:
        for worker in list(self._workers):
            if worker.ready and not worker.owed and queue:
                task = queue.popleft()
                try:
                    worker.send_task(*task, len(self._specs))
                except OSError:  # it died while idle (e.g. killed by the OOM killer)
                    queue.appendleft(task)
                    self._replace(worker)

    def _seconds_to_next_deadline(self) -> float:
        deadlines = [w.since + (self._timeout_s if w.ready else STARTUP_TIMEOUT_S)
                     for w in self._workers if w.owed or not w.ready]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0

    def _drain(self, worker: _Worker, queue: deque) -> Iterator[tuple[int, int, Outcome]]:
        while True:
            try:
                if not worker.conn.poll():
                    return
                message = worker.conn.recv()
            except (EOFError, OSError):
                yield from self._on_death(worker, queue)
                return
            if not worker.ready:
                self._on_startup_message(worker, message)
                continue
            index, f, outcome = message
            assert worker.owed.popleft() == (index, f), "worker answered out of order"
            worker.since = time.monotonic()
            yield index, f, outcome

    def _on_startup_message(self, worker: _Worker, message: tuple) -> None:
        if message[0] == "load_error":
            raise RLHFError(f"a reward worker process could not load the reward functions: "
                            f"{message[1]}")
        worker.ready, worker.since = True, time.monotonic()

    def _on_death(self, worker: _Worker, queue: deque) -> Iterator[tuple[int, int, Outcome]]:
        code = reap(worker.proc)
        if not worker.ready:
            self._replace(worker)
            raise RLHFError(f"a reward worker process exited with code {code} while loading "
                            f"the reward functions {self._specs}")
        index, f = worker.owed[0]
        yield index, f, ("error", f"its worker process died (exit code {code}) during the call")
        self._requeue_and_replace(worker, queue)

    def _check_deadline(self, worker: _Worker, queue: deque):
        limit = self._timeout_s if worker.ready else STARTUP_TIMEOUT_S
        if (worker.ready and not worker.owed) or time.monotonic() - worker.since < limit:
            return None
        if worker.conn.poll():
            return None  # it answered meanwhile; read it on the next round
        if not worker.ready:
            self._replace(worker)
            raise RLHFError(f"a reward worker process did not load {self._specs} within "
                            f"{STARTUP_TIMEOUT_S:.0f}s; importing them hangs")
        index, f = worker.owed[0]
        message = (f"it did not return within timeout_s={self._timeout_s:g}s; its worker "
                   f"process was killed and replaced")
        self._requeue_and_replace(worker, queue)
        return index, f, ("timeout", message)

    def _requeue_and_replace(self, worker: _Worker, queue: deque) -> None:
        rest = worker.remaining_task(len(self._specs))
        if rest is not None:
            queue.appendleft(rest)
        self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._loads)

    def close(self) -> None:
        """Stop every worker: ask politely, then kill whatever is still running."""
        self._finalizer()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        if worker.owed:  # in a call (an interrupted batch): it would not read the stop
            worker.proc.kill()
            continue
        try:
            worker.conn.send(None)
        except (OSError, ValueError):
            pass  # already dead or closed
    for worker in workers:
        if reap(worker.proc) is None:
            worker.proc.kill()
            reap(worker.proc)
        worker.conn.close()


def reap(proc: subprocess.Popen) -> int | None:
    """Exit code of proc once it ends (None if it is still running after a short wait)."""
    try:
        return proc.wait(_JOIN_S)
    except subprocess.TimeoutExpired:
        return None
