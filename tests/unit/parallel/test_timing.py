"""Stopwatch: host clock on the CPU; CUDA events on CUDA (through a fake event class), read
back once, when asked, never inside the timed blocks."""

import time

import torch

from rlhf.parallel import timing
from rlhf.parallel.timing import Stopwatch


def test_on_the_cpu_the_stopwatch_adds_up_host_time():
    watch = Stopwatch("cpu")
    for _ in range(2):
        with watch():
            time.sleep(0.01)
    assert 0.02 <= watch.seconds < 1.0


class FakeEvent:
    """torch.cuda.Event's timing interface; the 'device' time is a counter the test advances."""

    now_ms, waits = 0.0, 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = FakeEvent.now_ms

    def synchronize(self):
        FakeEvent.waits += 1

    def elapsed_time(self, end):
        return end.at - self.at


def test_on_cuda_the_stopwatch_times_the_stream_with_events_and_waits_once(monkeypatch):
    monkeypatch.setattr(timing.torch.cuda, "Event", FakeEvent)
    FakeEvent.now_ms, FakeEvent.waits = 0.0, 0
    watch = Stopwatch(torch.device("cuda", 0))
    for work_ms in (30.0, 12.0):
        with watch():
            FakeEvent.now_ms += work_ms  # the stream runs the queued work
        FakeEvent.now_ms += 100.0  # work outside the blocks is not counted
    assert FakeEvent.waits == 0  # nothing waited while the blocks ran
    assert watch.seconds == 0.042
    assert FakeEvent.waits == 1
