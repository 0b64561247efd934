"""A real Ray cluster of several nodes on this machine, started with `ray start` as users do.

Every node listens on 127.0.0.1 with ports of its own, keeps its files under one temporary
folder, and is started from a folder of its own (its workers' working directory), so nothing
the test does can reach the test session's own Ray or resolve a path by accident. Token
authentication is explicitly off (RAY_AUTH_MODE=disabled) for the whole cluster and its clients.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_env(**extra: str) -> dict[str, str]:
    """The environment of every process the test starts: this repository first on the path,
    one thread per process, no token authentication, and no inherited Ray address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0", **extra)
    return env


class LoopbackCluster:
    """Head plus worker nodes, one CPU each; `stop()` kills every node's processes."""

    def __init__(self, root: Path):
        self.root = root
        # A short folder of its own: Ray's socket paths must fit in 107 characters.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rlhf-mn-", dir="/tmp"))
        self.port, self.dashboard_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.nodes: dict[str, subprocess.Popen] = {}

    def start_node(self, name: str, *, head: bool = False, timeout_s: float = 120) -> None:
        """`ray start --block` in folder root/<name>; returns once Ray says it started."""
        ports = ["--node-manager-port", str(free_port()), "--object-manager-port",
                 str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                 "--metrics-export-port", str(free_port()), "--runtime-env-agent-port",
                 str(free_port())]
        low = 30000 + 1000 * len(self.nodes) + (os.getpid() % 20) * 100
        args = [RAY, "start", "--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
                "--temp-dir", str(self.temp_dir), "--disable-usage-stats",
                "--min-worker-port", str(low), "--max-worker-port", str(low + 99), *ports]
        if head:
            args += ["--head", "--port", str(self.port), "--include-dashboard", "true",
                     "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                     "--ray-client-server-port", str(free_port())]
        else:
            args += ["--address", self.address]
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        log = open(folder / "ray-start.log", "w")
        proc = subprocess.Popen(args, cwd=folder, env=client_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes[name] = proc
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in (folder / "ray-start.log").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start of {name} failed:\n"
                                   f"{(folder / 'ray-start.log').read_text()[-3000:]}")
            time.sleep(0.5)

    def kill_node(self, name: str) -> None:
        """The node's raylet and helpers die at once (its workers follow when they see it)."""
        proc = self.nodes.pop(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def stop(self) -> None:
        """Stop every node, the head last; remove the cluster's files."""
        for name in [n for n in self.nodes if n != "head"] + ["head"] * ("head" in self.nodes):
            proc = self.nodes.pop(name)
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def query(self, code: str, timeout_s: float = 120) -> object:
        """The JSON a small driver prints after joining the cluster as `ray` (code's last line
        assigns `out`)."""
        script = ("import json, ray\nray.init(address=%r, logging_level='ERROR')\n%s\n"
                  "print('@@' + json.dumps(out))\nray.shutdown()\n" % (self.address, code))
        done = subprocess.run([sys.executable, "-c", script], env=client_env(), cwd=self.root,
                              capture_output=True, text=True, timeout=timeout_s)
        lines = [line for line in done.stdout.splitlines() if line.startswith("@@")]
        assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
        return json.loads(lines[-1][2:])

    def node_ids(self) -> dict[str, bool]:
        """{node id: is the head} of the alive nodes."""
        return self.query("out = {n['NodeID']: 'node:__internal_head__' in n['Resources'] "
                          "for n in ray.nodes() if n['Alive']}")
