"""`rlhf bench engine` on the CPU, small: one training step timed, memory against the planner,
bf16 log-probs against transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = str(Path(__file__).resolve().parents[3])


def test_bench_engine_prints_speed_memory_against_the_plan_and_logprob_agreement():
    argv = ["--size", "tiny", "--layers", "2", "--tokens", "256", "--seq-len", "64",
            "--micro-batches", "2", "--steps", "1"]
    proc = subprocess.run([sys.executable, "-m", "rlhf.cli", "bench", "engine", *argv],
                          capture_output=True, text=True, timeout=580, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = {x["kind"]: x for x in map(json.loads, proc.stdout.strip().splitlines())}
    assert set(lines) == {"config", "step", "memory", "logprobs"}
    assert lines["config"]["device"] == "cpu" and lines["config"]["tokens_per_step"] == 512
    step = lines["step"]
    assert step["tokens_per_s"] > 0 and step["peak_source"].startswith("measured")
    assert 0 < step["mfu"] == pytest.approx(
        step["model_tflops_per_s"] / step["peak_tflops_per_s"], rel=0.05, abs=1e-3)
    memory = lines["memory"]
    assert memory["held_state_bytes"] == memory["planned_state_bytes"]  # exact
    # the activation estimate (flash attention) is within 30% of what the CPU path saves
    assert 0.7 < memory["activation_ratio"] < 1.3
    logprobs = lines["logprobs"]
    assert logprobs["tokens"] == 4 * (64 - 16)  # every response token of one micro-batch
    assert 0 <= logprobs["mean_abs_diff"] <= logprobs["max_abs_diff"] < 0.05  # bf16 rounding
