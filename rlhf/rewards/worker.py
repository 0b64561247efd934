"""What runs inside a reward worker process: load the functions once, then score chunks.

Imports nothing heavy (no torch), so a worker starts in a fraction of a second. Messages to
the driver: ("ready",), ("load_error", text), and one (index, function, outcome) per call,
sent as soon as the call returns so the driver can time every call on its own.
"""

import os
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from rlhf.errors import RLHFError
from rlhf.rewards.loader import load_reward_function, user_traceback
from rlhf.rewards.protocol import BadReturn, parse_reward_output

# An outcome is ("ok", score, metrics), ("error", text) or ("timeout", text).
Outcome = tuple


def call_reward(fn: Callable, sample: dict) -> Outcome:
    """Call fn on one sample and check its return value; never raises for user errors."""
    try:
        value = fn(prompt=sample["prompt"], response=sample["response"],
                   ground_truth=sample["ground_truth"], extra=dict(sample["extra"]))
    except Exception as e:
        return ("error", "it raised:\n" + user_traceback(e))
    try:
        score, metrics = parse_reward_output(value)
    except BadReturn as e:
        return ("error", f"it returned a bad value: {e}")
    return ("ok", score, metrics)


def _exit_with_parent(parent_pid: int) -> None:
    # A call stuck in user code never reads the closed pipe; don't outlive a killed driver.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def serve_loop(conn: Connection, load: Callable, handle: Callable) -> None:
    """A worker's life on its pipe: load(first message) -> ("ready",) or ("load_error", text),
    then handle(loaded, task, conn.send) for each task until None or a closed pipe."""
    first = conn.recv()
    try:
        loaded = load(first)
    except Exception as e:
        conn.send(("load_error", str(e) if isinstance(e, RLHFError) else user_traceback(e)))
        return
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if task is None:
            return
        handle(loaded, task, conn.send)


def _load_functions(loads: list[tuple[str, str]]) -> list[Callable]:
    return [load_reward_function(spec, convention=convention) for spec, convention in loads]


def _score_chunk(functions: list[Callable], task: tuple, send: Callable) -> None:
    items, first_function = task
    for position, (index, sample) in enumerate(items):
        # A chunk resumed after a timeout starts part-way through its first sample.
        start = first_function if position == 0 else 0
        for f in range(start, len(functions)):
            send((index, f, call_reward(functions[f], sample)))


def child_main(load: Callable, handle: Callable) -> None:
    """The body of a spawned worker (`python -c "...main()" FD PARENT_PID`, see
    rlhf.rewards.processes.spawn_child): serve_loop on the pipe, ending with the parent."""
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    serve_loop(Connection(fd), load, handle)


def main() -> None:
    """Entry point of a reward worker, started by rlhf.rewards.processes: load the functions the
    driver names, then score chunks until told to stop."""
    child_main(_load_functions, _score_chunk)
