"""A real Ray cluster of several nodes on this machine, started with `ray start` as users do.

Every node listens on 127.0.0.1 with ports of its own, keeps its files in a temporary folder of
its own (as separate machines would: nodes sharing one would unpack a job's working_dir into
the same folder at once), and is started from a folder of its own (its workers' working
directory), so nothing the test does can reach the test session's own Ray or resolve a path
by accident. Token
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
# Every node of a loopback cluster reaches the others over the loopback interface; a job whose
# ranks span nodes refuses to start without it (rlhf.controller.nodes.check_node_interfaces).
NODE_ENV = {"GLOO_SOCKET_IFNAME": "lo"}
NETWORK_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# Ray's system config of the whole cluster (set on the head; every raylet reads it from GCS):
# - a lost node is declared dead after 3 failed health checks 1 s apart, ~3 s after the kill,
#   before job B has stopped and job C is submitted (Ray's 5 checks 3 s apart, ~15 s, would
#   still count it alive then); a live raylet still gets health_check_timeout_ms (10 s) to
#   answer each check, so a busy machine does not lose a node by mistake;
# - no idle worker prestarted when the first driver connects: the jobs' drivers bring a
#   runtime_env, so their actors start workers of their own and the prestarted ones sit unused;
# - an idle worker lives 60 s, not 1 s: a job's checks on each node (rlhf.controller.nodes: the
#   network variables, then the reward file's import) are tasks a few seconds apart, and each
#   fresh worker imports torch with rlhf, so the second check reuses the first one's workers.
SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                 "prestart_worker_first_driver": False,
                 "idle_worker_killing_time_threshold_ms": 60_000}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_env(**extra: str) -> dict[str, str]:
    """The environment of every process the test starts: this repository first on the path,
    one thread per process, no token authentication, and no inherited Ray address or network
    variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in NETWORK_VARIABLES}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0", **extra)
    return env


class LoopbackCluster:
    """Head plus worker nodes, one CPU each; `stop()` kills every node's processes."""

    def __init__(self, root: Path):
        self.root = root
        # Short folders: Ray's socket paths must fit in 107 characters.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rlhf-mn-", dir="/tmp"))
        self.port, self.dashboard_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.nodes: dict[str, subprocess.Popen] = {}
        self._started = 0

    def start_node(self, name: str, *, head: bool = False, timeout_s: float = 180,
                   env: dict[str, str] | None = None) -> None:
        """`ray start --block` in folder root/<name>; returns when Ray says it started. The
        node carries the resource `mn_<name>` so tests can tell the nodes apart. Start nodes
        one at a time: nodes of one address starting together may take each other's raylet.
        `env`: the node's network variables (default NODE_ENV, as a user sets them before
        `ray start`)."""
        ports = ["--node-manager-port", str(free_port()), "--object-manager-port",
                 str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                 "--metrics-export-port", str(free_port()), "--runtime-env-agent-port",
                 str(free_port())]
        self._started += 1  # its own range of worker ports, even for a node started again
        low = 30000 + 1000 * self._started + (os.getpid() % 20) * 50
        args = [RAY, "start", "--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
                "--resources", json.dumps({f"mn_{name}": 1}), "--temp-dir",
                str(self.temp_dir / name), "--disable-usage-stats", "--min-worker-port",
                str(low), "--max-worker-port", str(low + 49), *ports]
        if head:
            args += ["--head", "--port", str(self.port), "--system-config",
                     json.dumps(SYSTEM_CONFIG), "--include-dashboard", "true",
                     "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                     "--ray-client-server-port", str(free_port())]
        else:
            args += ["--address", self.address]
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "ray-start.log"
        with open(log, "w") as out:
            proc = self.nodes[name] = subprocess.Popen(
                args, cwd=folder, env=client_env(**(NODE_ENV if env is None else env)),
                stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start of {name} failed:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def kill_node(self, name: str) -> None:
        """Every process of the node dies at once, as when its machine goes away: the raylet
        and helpers (its process group) and the workers the raylet started, which would
        otherwise run on until they notice their raylet is gone (a whole training step, on a
        loaded machine)."""
        proc = self.nodes.pop(name)
        workers = _descendants(proc.pid)
        _signal_group(proc, signal.SIGKILL)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL after a few seconds); remove its files."""
        procs, self.nodes = list(self.nodes.values()), {}
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def query(self, code: str, timeout_s: float = 120) -> object:
        """The JSON a small driver prints after joining the cluster as `ray` (code's last line
        assigns `out`)."""
        script = (f"import json, ray\nray.init(address={self.address!r}, logging_level='ERROR')\n"
                  f"{code}\nprint('@@' + json.dumps(out))\nray.shutdown()\n")
        done = subprocess.run([sys.executable, "-c", script], env=client_env(), cwd=self.root,
                              capture_output=True, text=True, timeout=timeout_s)
        lines = [line for line in done.stdout.splitlines() if line.startswith("@@")]
        assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
        return json.loads(lines[-1][2:])

    def node_ids(self) -> dict[str, str]:
        """{node id: name given to start_node} of the alive nodes, from the dashboard's state
        API: no driver process joins the cluster to ask."""
        from ray.util.state import list_nodes

        return {n.node_id: k[3:] for n in list_nodes(address=self.dashboard, limit=1000)
                if n.state == "ALIVE" for k in n.resources_total if k.startswith("mn_")}


def _descendants(pid: int) -> list[int]:
    """The ids of every process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # a process that just ended
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the node's own process group (start_new_session)
    except ProcessLookupError:
        pass
