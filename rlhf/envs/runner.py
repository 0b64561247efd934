"""EnvRunner: the episodes of one environment class, in worker processes, each call timed.

Episode e lives in worker e % num_workers for its whole life (an environment has state). Each
round of calls sends every worker its calls in one message; the worker streams back one answer
per call, so the runner knows which call a worker is in and since when. A worker silent for
timeout_s is killed (SIGKILL reaches a call stuck in C code) and replaced: its current call
times out, and every other episode it held is lost (their later calls report it). num_workers
= 0 runs the environments in the calling process, without time limits (debugging).
"""

from __future__ import annotations

import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any

from rlhf.envs.worker import Outcome, call_env, load_env_class
from rlhf.errors import RLHFError
from rlhf.rewards.processes import STARTUP_TIMEOUT_S, reap, spawn_child
from rlhf.trace import span


class _EnvWorker:
    def __init__(self, spec: str, kwargs: dict):
        self.proc, self.conn = spawn_child("rlhf.envs.worker")
        self.conn.send((spec, kwargs))
        self.ready = False
        self.owed: deque[int] = deque()  # episodes whose answers are due, in order
        self.episodes: set[int] = set()  # episodes whose environments it holds
        self.since = time.monotonic()

    def kill(self) -> None:
        self.proc.kill()
        reap(self.proc)
        self.conn.close()


class EnvRunner:
    """Runs `reset`/`step`/`end` calls on episodes of the environment `spec`; see the module
    docstring. Every method takes {episode: payload} and returns {episode: outcome}."""

    def __init__(self, spec: str, kwargs: dict | None = None, *, num_workers: int = 2,
                 timeout_s: float = 30.0):
        self.spec, self.kwargs, self.timeout_s = spec, dict(kwargs or {}), timeout_s
        self._cls = load_env_class(spec)  # a bad spec fails here, before any process starts
        self._local: dict[int, Any] = {}
        self._workers = [_EnvWorker(spec, self.kwargs) for _ in range(num_workers)]
        self._lost: dict[int, str] = {}  # episode -> why its environment is gone

    def reset(self, rows: dict[int, dict]) -> dict[int, Outcome]:
        """Build and reset one environment per episode from its dataset row."""
        for episode in rows:
            self._lost.pop(episode, None)
        return self._run("reset", rows)

    def step(self, turns: dict[int, dict]) -> dict[int, Outcome]:
        """Send each episode its model turn ({"text", "token_ids"}); outcome value: StepResult."""
        with span("env_turn", episodes=len(turns)):
            return self._run("step", turns)

    def end(self, episodes) -> None:
        """Drop the environments of finished episodes."""
        self._run("end", {e: {} for e in episodes if e not in self._lost})

    def _run(self, method: str, payloads: dict[int, dict]) -> dict[int, Outcome]:
        out = {e: ("error", self._lost[e]) for e in payloads if e in self._lost}
        todo = {e: p for e, p in payloads.items() if e not in self._lost}
        if not self._workers:
            out.update({e: call_env(self._cls, self.kwargs, self._local, e, method, p)
                        for e, p in todo.items()})
            return out
        per_worker: dict[int, list] = {}
        for e, p in todo.items():
            per_worker.setdefault(e % len(self._workers), []).append((e, method, p))
        for w, calls in per_worker.items():
            held = self._workers[w].episodes
            if method == "reset":
                held.update(e for e, _, _ in calls)
            elif method == "end":
                held.difference_update(e for e, _, _ in calls)
            self._send(w, calls)
        while any(worker.owed for worker in self._workers):
            self._collect(out)
        return out

    def _send(self, w: int, calls: list) -> None:
        worker = self._workers[w]
        worker.owed.extend(e for e, _, _ in calls)
        if worker.ready:
            worker.since = time.monotonic()
        try:
            worker.conn.send(calls)  # a worker still starting reads it once it is ready
        except OSError:
            pass  # it died; _collect reads the EOF and reports the calls

    def _collect(self, out: dict[int, Outcome]) -> None:
        busy = [w for w in self._workers if w.owed]
        now = time.monotonic()
        deadline = min(w.since + (self.timeout_s if w.ready else STARTUP_TIMEOUT_S) for w in busy)
        ready = wait([w.conn for w in busy], timeout=max(0.0, deadline - now))
        for worker in busy:
            if worker.conn in ready:
                self._drain(worker, out)
            elif time.monotonic() - worker.since >= (self.timeout_s if worker.ready
                                                     else STARTUP_TIMEOUT_S):
                self._fail(worker, out, "timeout" if worker.ready else "error",
                           f"it did not return within rollout.env.timeout_s={self.timeout_s:g}s; "
                           f"its worker process was killed and replaced" if worker.ready else
                           f"its worker process did not load {self.spec!r} within "
                           f"{STARTUP_TIMEOUT_S:.0f}s")

    def _drain(self, worker: _EnvWorker, out: dict[int, Outcome]) -> None:
        while worker.owed:
            try:
                if not worker.conn.poll():
                    return
                message = worker.conn.recv()
            except (EOFError, OSError):
                code = reap(worker.proc)
                self._fail(worker, out, "error",
                           f"its worker process died (exit code {code}) during the call")
                return
            if not worker.ready:
                if message[0] == "load_error":
                    raise RLHFError(f"an environment worker could not load {self.spec!r}: "
                                    f"{message[1]}")
                worker.ready, worker.since = True, time.monotonic()
                continue
            episode, outcome = message
            assert worker.owed.popleft() == episode, "environment worker answered out of order"
            out[episode] = outcome
            worker.since = time.monotonic()

    def _fail(self, worker: _EnvWorker, out: dict[int, Outcome], kind: str, why: str) -> None:
        """Kill and replace worker: its current call gets (kind, why); every episode it held
        is lost."""
        w = self._workers.index(worker)
        current = worker.owed.popleft()
        out[current] = (kind, why)
        lost = (f"its environment was lost: episode {current}'s call failed in the same worker "
                f"process, which was killed ({why})")
        for episode in worker.owed:
            out[episode] = ("error", lost)
        self._lost.update({e: lost for e in worker.episodes if e != current})
        self._lost[current] = f"its environment was lost in an earlier call: {why}"
        worker.kill()
        self._workers[w] = _EnvWorker(self.spec, self.kwargs)

    def close(self) -> None:
        """Stop the worker processes; safe to call twice."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            if reap(worker.proc) is None:
                worker.kill()
            worker.conn.close()
        self._workers = []
