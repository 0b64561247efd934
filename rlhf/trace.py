"""Spans for the step timeline (`trainer.trace`), and the Chrome trace / Perfetto file they make.

Each process (the driver, every rank's actor) records into its own `RECORDER`, like a logger:
`with span("forward", tokens=n): ...` costs one attribute check while recording is off. Spans
carry wall-clock microseconds of the process that recorded them; the driver measures each
process's clock against its own (`clock_offset`, the ping with the shortest round trip) and
`chrome_trace` shifts every span onto the driver's clock, so spans of ranks on other nodes line
up with the driver's phases. A span is (name, role, start_us, dur_us, thread, args).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Span = tuple[str, str, int, int, int, dict[str, Any]]
TRACE_DIR = "trace"  # under output_dir: one file per traced step
_NULL = contextlib.nullcontext()


def now_us() -> int:
    """This process's wall clock in microseconds (the clock spans and pings use)."""
    return time.time_ns() // 1000


class SpanRecorder:
    """The spans of one process while `on`; `take()` hands them over and starts afresh."""

    def __init__(self) -> None:
        self.on = False
        self.role = ""  # the role whose method runs now: nested spans are filed under it
        self._spans: list[Span] = []

    def span(self, name: str, **args: Any) -> contextlib.AbstractContextManager:
        """A context that records `name` (with `args`, e.g. tokens or bytes) when on."""
        return _Open(self, name, args) if self.on else _NULL

    @contextlib.contextmanager
    def role_call(self, role: str, method: str) -> Iterator[None]:
        """Around a role method: its span, and the role of the spans recorded inside it."""
        outer, self.role = self.role, role
        try:
            with self.span(method, role_method=True):  # a report sums these per role
                yield
        finally:
            self.role = outer

    def add(self, span: Span) -> None:
        self._spans.append(span)  # list.append is atomic: other threads may record too

    def take(self) -> list[Span]:
        spans, self._spans = self._spans, []
        return spans


class _Open:
    __slots__ = ("rec", "name", "args", "role", "start")

    def __init__(self, rec: SpanRecorder, name: str, args: dict[str, Any]):
        self.rec, self.name, self.args, self.role = rec, name, args, rec.role

    def __enter__(self) -> _Open:
        self.start = now_us()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = now_us()
        self.rec.add((self.name, self.role, self.start, end - self.start,
                      threading.get_native_id(), self.args))


RECORDER = SpanRecorder()


def span(name: str, **args: Any) -> contextlib.AbstractContextManager:
    """`RECORDER.span`: the one call the engine, workers and trainer make."""
    return RECORDER.span(name, **args)


def clock_offset(pings: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """(offset_us, error_us) of a remote clock from pings (sent, remote reading, received),
    all in microseconds: remote minus the local midpoint of the shortest round trip, whose
    half is the bound on the error."""
    if not pings:
        raise ValueError("clock_offset needs at least one ping")
    sent, remote, received = min(pings, key=lambda p: p[2] - p[0])
    if received < sent:
        raise ValueError(f"a ping came back before it was sent ({sent} -> {received} us)")
    return remote - (sent + received) // 2, (received - sent + 1) // 2


@dataclass(frozen=True)
class ProcessSpans:
    """One process's spans of a step and its clock's offset to the driver's (µs)."""

    name: str  # e.g. "driver" or "actor+ref:1" (group label and rank)
    spans: list[Span]
    offset_us: int = 0
    error_us: int = 0


def chrome_trace(processes: Sequence[ProcessSpans], *, step: int) -> dict[str, Any]:
    """A Chrome trace / Perfetto JSON object: one track per process and thread, every span
    moved onto the driver's clock and timed from the step's first span."""
    starts = [s[2] - p.offset_us for p in processes for s in p.spans]
    origin = min(starts) if starts else 0
    events: list[dict[str, Any]] = []
    for pid, proc in enumerate(processes):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": proc.name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        threads: dict[int, int] = {}
        for name, role, start, dur, thread, args in proc.spans:
            tid = threads.setdefault(thread, len(threads))
            events.append({"name": name, "cat": role or "driver", "ph": "X", "pid": pid,
                           "tid": tid, "ts": start - proc.offset_us - origin, "dur": dur,
                           "args": {**args, "role": role or "driver", "step": step}})
    clocks = {p.name: {"offset_us": p.offset_us, "error_us": p.error_us} for p in processes}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step": step, "origin_us": origin, "clocks": clocks}}


def trace_path(output_dir: str | Path, step: int) -> Path:
    """Where step `step`'s timeline is written."""
    return Path(output_dir) / TRACE_DIR / f"step_{step:06d}.json"


def write_trace(output_dir: str | Path, step: int, processes: Sequence[ProcessSpans]) -> Path:
    """Write step `step`'s timeline (atomically: a report may read it while the run goes)."""
    path = trace_path(output_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(chrome_trace(processes, step=step)), encoding="utf-8")
    tmp.replace(path)
    return path
