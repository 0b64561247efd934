"""StopRequests: a signal or the trainer.max_hours deadline asks the loop to stop at its next
safe point; a second signal exits at once."""

import os
import signal
import subprocess
import sys

from rlhf.trainer.preemption import EXIT_PREEMPTED, StopRequests


def test_a_signal_asks_to_stop_and_the_previous_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequests(on_signal=True, max_hours=None) as stop:
        assert stop.reason() is None
        os.kill(os.getpid(), signal.SIGTERM)  # delivered before the next bytecode
        assert stop.reason() == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_save_on_signal_off_leaves_the_handlers_alone():
    before = signal.getsignal(signal.SIGINT)
    with StopRequests(on_signal=False, max_hours=None):
        assert signal.getsignal(signal.SIGINT) is before


def test_the_deadline_stops_before_a_step_as_long_as_the_longest_would_cross_it():
    now = [0.0]
    with StopRequests(on_signal=False, max_hours=1.0, clock=lambda: now[0]) as stop:
        now[0] = 3000.0
        stop.step_took(500.0)
        assert stop.reason() is None  # 3000 + 500 < 3600
        stop.step_took(200.0)  # the longest step counts
        now[0] = 3100.0
        assert stop.reason() == "trainer.max_hours=1 reached"


def test_a_second_signal_exits_at_once_with_128_plus_its_number():
    code = ("import os, signal, time\n"
            "from rlhf.trainer.preemption import StopRequests\n"
            "with StopRequests(on_signal=True, max_hours=None) as stop:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    assert stop.reason() == 'SIGINT'\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert f"exiting with status {EXIT_PREEMPTED}" in proc.stderr
    assert "SIGINT again: exiting now" in proc.stderr
