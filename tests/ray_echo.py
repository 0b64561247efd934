"""Capturing a command's own stderr in a pytest process where Ray may be live.

A Ray cluster that an earlier test on the same pytest worker started keeps echoing its
processes' lines (a raylet's low-disk warning, an actor's log) to this process's stderr from a
background thread. Those lines are not the output under test, so a test that checks stderr
line for line mutes the echo while it captures.
"""

import contextlib
import importlib.util


@contextlib.contextmanager
def ray_echo_muted():
    if importlib.util.find_spec("ray") is None:  # a bare GPU box: no Ray, nothing echoes
        yield
        return
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    handlers, dispatcher.handlers = dispatcher.handlers, []
    try:
        yield
    finally:
        dispatcher.handlers = handlers
