"""The step timeline (trainer.trace): which steps record spans, and their trace files.

The spans of every rank stay in its process until the step ends; then the driver takes them
with one call per rank, after pinging its clock (rlhf.controller.WorkerGroup.take_spans). That
is cheaper than per-rank files under output_dir: the driver needs the round trips anyway to
measure the clock offsets, a traced step's spans are a few kB, and nothing depends on a shared
folder or on merging files written by processes that may still be running.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from pathlib import Path

from rlhf.config.schema import TrainerConfig
from rlhf.trace import RECORDER, ProcessSpans, write_trace


class Timeline:
    """Records the steps trainer.trace picks: the driver's phases and every rank's spans,
    written as output_dir/trace/step_NNNNNN.json (rlhf.trace)."""

    def __init__(self, cfg: TrainerConfig, views: Mapping[str, object], output_dir: str | Path):
        self.cfg, self.output_dir = cfg, Path(output_dir)
        # Colocated roles share a group: each process is asked once. Views without a group
        # (a test's fakes) have no ranks to trace.
        groups = [getattr(view, "group", None) for view in views.values()]
        self.groups = list({id(g): g for g in groups if hasattr(g, "take_spans")}.values())
        self._ranks_recording = False

    def begin(self, step: int) -> None:
        """Start recording if `step` is traced (the ranks may be recording already)."""
        if not self.cfg.traces(step):
            return
        RECORDER.take()
        RECORDER.on = True
        if not self._ranks_recording:
            for group in self.groups:
                group.take_spans(record=True, pings=0)
            self._ranks_recording = True

    def end(self, step: int) -> dict[str, float]:
        """Write `step`'s timeline if it was traced; the ranks go on recording only if the
        next step is traced too. Returns `timing/trace`, the seconds this took, if traced."""
        if not self.cfg.traces(step):
            return {}
        began = time.perf_counter()
        keep = self.cfg.traces(step + 1)
        RECORDER.on = keep
        processes = [ProcessSpans("driver", RECORDER.take())]
        for group in self.groups:
            processes += group.take_spans(record=keep)
        self._ranks_recording = keep
        write_trace(self.output_dir, step, processes)
        return {"timing/trace": time.perf_counter() - began}

    def close(self) -> None:
        """Stop recording everywhere (a run that ends or fails mid-step)."""
        RECORDER.on = False
        RECORDER.take()
        if self._ranks_recording:
            self._ranks_recording = False
            for group in self.groups:
                # best effort: a group that failed has raised its own error already
                with contextlib.suppress(Exception):
                    group.take_spans(record=False, pings=0)
