"""Stopping a run early with its work saved: on SIGTERM or SIGINT (a scheduler preempting the
job, `ray job stop`, Ctrl-C) or when trainer.max_hours is about to run out, the training loop
finishes the step in progress, writes a checkpoint of it and `rlhf train` exits with
EXIT_PREEMPTED; running the same command again resumes there.

Only the driver handles the signals (it runs the loop; the Ray workers do the work and are
stopped with it). While the loop runs these handlers replace the driver's own (Python's
KeyboardInterrupt, and the SIGTERM handler a local Ray head installs to shut itself down), and
put them back when it ends; Ray's processes share the driver's fate, so an immediate exit leaves
none behind. A second signal exits at once with 128 + its number: nothing is left half
written, because every checkpoint is assembled in a temporary folder and published by one
rename (rlhf.trainer.checkpoint), and the next start deletes or ignores the temporary folder.
The step in progress is finished rather than abandoned: a step's updates change the workers'
weights, so the only safe points are between steps; a step must therefore fit in the
scheduler's grace period (else use trainer.max_hours, which stops before the limit).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: a temporary failure, run the same command again
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The loop stopped early for `reason` after saving `checkpoint` (step `step`)."""

    def __init__(self, *, step: int, reason: str, checkpoint: Path):
        super().__init__(f"stopped after step {step} ({reason}); saved {checkpoint}; run the "
                         "same command again to resume from it")
        self.step, self.reason, self.checkpoint = step, reason, checkpoint


class StopRequests:
    """A context in which SIGTERM/SIGINT (when `on_signal`) and the `max_hours` deadline,
    counted from entering, ask the loop to stop at its next safe point (`reason`)."""

    def __init__(self, *, on_signal: bool, max_hours: float | None,
                 clock: Callable[[], float] = time.monotonic):
        self.on_signal, self.max_hours, self.clock = on_signal, max_hours, clock
        self.signalled: str | None = None
        self.deadline: float | None = None
        self.longest_step_s = 0.0  # a step plus its save, the longest one so far
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if self.max_hours is not None:
            self.deadline = self.clock() + self.max_hours * 3600
        # Python delivers signals to the main thread only; elsewhere (a loop run from a
        # thread) the previous handlers stay and only the deadline applies.
        if self.on_signal and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signalled is not None:
            print(f"{name} again: exiting now without a checkpoint (the last complete one "
                  "stays usable)", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signalled = name
        print(f"{name} received: finishing the current step, then saving a checkpoint and "
              f"exiting with status {EXIT_PREEMPTED}; send it again to exit at once",
              file=sys.stderr, flush=True)

    def step_took(self, seconds: float) -> None:
        """Record one step's duration (its save included) for the deadline's estimate."""
        self.longest_step_s = max(self.longest_step_s, seconds)

    def reason(self) -> str | None:
        """Why the loop should stop now: a signal, or another step (as long as the longest so
        far) would end past the deadline; None to go on."""
        if self.signalled is not None:
            return self.signalled
        if self.deadline is not None and self.clock() + self.longest_step_s >= self.deadline:
            return f"trainer.max_hours={self.max_hours:g} reached"
        return None
