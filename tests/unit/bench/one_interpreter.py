"""Several `rlhf bench` commands in one fresh interpreter, for benchmarks that must not run in
the test process (a Ray cluster or a vLLM engine of their own): torch, transformers, Ray and
vLLM are imported once for all of them instead of once each."""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import RANK_PRELOAD

ROOT = str(Path(__file__).resolve().parents[3])
# The ranks benchmarks launch (rlhf.parallel.launch) fork from one server that imported these
# once, as the suite's own launches do; vLLM too, which each rank of `bench sync` builds an
# engine with.
BENCH_RANK_PRELOAD = [*RANK_PRELOAD, "vllm"]
# Printed after each command's stdout, with its exit status.
END = "--- end of command, exit status"
SCRIPT = f"""
import contextlib, json, sys, traceback
from rlhf.cli import main
from rlhf.parallel.launch import fork_ranks_from_a_server
fork_ranks_from_a_server(json.loads(sys.argv[2]))
ray_cpus = json.loads(sys.argv[3])
with contextlib.ExitStack() as shared:
    if ray_cpus is not None:
        # One local Ray for every command, started as a benchmark starts its own
        # (rlhf.trainer.jobs.init_ray), and their rank processes kept between them.
        import ray
        from rlhf.config.schema import JobConfig, RayConfig
        from rlhf.controller.warm import keep_ranks_warm
        from rlhf.trainer.jobs import init_ray
        with contextlib.redirect_stdout(sys.stderr):
            init_ray(JobConfig(ray=RayConfig(num_cpus=ray_cpus)), env_address=None)
        shared.callback(ray.shutdown)
        shared.enter_context(keep_ranks_warm())
    for argv in json.loads(sys.argv[1]):
        try:
            rc = main(["bench", *argv])
        except SystemExit as exc:  # a refusal: what `python -m rlhf.cli` would exit with
            rc = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            print(exc.code, file=sys.stderr)
        except Exception:
            rc = 1
            traceback.print_exc()
        sys.stderr.flush()
        print("{END}", rc, flush=True)
"""


@dataclass
class Run:
    """One command's exit status and stdout; `stderr` is the whole interpreter's."""

    rc: int
    stdout: str
    stderr: str

    def json_lines(self) -> list[dict]:
        """The stdout's lines, each one JSON object (the benchmarks' contract)."""
        assert self.rc == 0, self.stderr[-4000:]
        return [json.loads(line) for line in self.stdout.strip().splitlines()]


def run_benchmarks(*commands: list[str], timeout_s: float,
                   ray_cpus: int | None = None) -> list[Run]:
    """Run `rlhf bench ARGV...` for each ARGV of `commands`, in turn, in one new interpreter.
    `ray_cpus`: the commands share one local Ray cluster of that many CPUs (a benchmark uses
    a running one instead of starting its own), whose rank processes one command's worker
    groups leave are the next one's (rlhf.controller.warm)."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(commands),
                           json.dumps(BENCH_RANK_PRELOAD), json.dumps(ray_cpus)],
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    parts = proc.stdout.split(END)
    assert len(parts) == len(commands) + 1, \
        f"the interpreter stopped early (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    runs, stdout = [], parts[0]
    for part in parts[1:]:
        status, _, rest = part.partition("\n")
        runs.append(Run(int(status), stdout, proc.stderr))
        stdout = rest
    assert stdout == "", f"output after the last command: {stdout[-2000:]}"
    return runs
