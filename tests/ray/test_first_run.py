"""examples/gpu_first_run.sh --cpu end to end: two steps of the tiny CPU job (vLLM on CPU, Ray
started by `rlhf train`), then the report, which passes; the same run folder with a receipt
made incomplete fails `rlhf run-report` naming it; a job that cannot start fails the
script's entry point (rlhf.bench.first_run.main) at once. The report's logic on synthetic
metrics: tests/unit/bench/test_first_run.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.bench.first_run import main as first_run_main
from rlhf.cli import main

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def first_run(tmp_path, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray's system config for the local Ray `rlhf train` starts: no idle worker prestarted per
    # CPU for the first driver; the job passes a runtime_env, so its rank never uses them.
    env["RAY_prestart_worker_first_driver"] = "0"
    return subprocess.run(
        ["bash", str(REPO / "examples" / "gpu_first_run.sh"), "--cpu", *args], cwd=tmp_path,
        env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=540)


def test_the_first_run_script_runs_two_steps_on_cpu_and_reports(tmp_path, capsys):
    done = first_run(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run = tmp_path / "outputs" / "first_run" / "run"  # the config's relative paths, from cwd
    report = (run / "first_run_report.txt").read_text()
    assert report in done.stdout
    assert report.startswith("steps: 2 of 2 logged (exit status 0)")
    for section in ("sync receipts:", "log-prob gap after sync", "device memory per phase",
                    "vLLM sleep", "NCCL communicators", "pinned host memory",
                    "seconds per phase:"):
        assert section in report, section
    assert "step 2: max " in report  # the gap after the first real sync
    assert report.rstrip().endswith("PASS: every step ran, every check held")
    assert "metrics:" in (run / "first_run.log").read_text()  # rlhf train's own output

    # A receipt made incomplete in step 2: the report of the same folder names it, exit 1.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records[1].update({"sync/receipts": 10.0, "sync/receipts_complete": 9.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # `rlhf run-report` in this process: a subprocess would import torch and rlhf again.
    capsys.readouterr()
    assert main(["run-report", str(run)]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("FAIL: sync incomplete (step 2): 1 of 10")


def test_a_job_that_cannot_start_fails_the_script_with_its_error(tmp_path, monkeypatch, capsys):
    # The script's own code in this process (the test above runs the script itself): one
    # Python start fewer, and `rlhf train` still runs and fails in its own process.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))  # as the script exports
    assert first_run_main(["--cpu", "model.tokenizer_path=no_tokenizer_here"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: run failed (step 1): `rlhf train` stopped before its first step" in out
    # the trainer's own error, shown
    assert "no_tokenizer_here': no such folder" in out
