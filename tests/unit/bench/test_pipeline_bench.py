"""`rlhf bench pipeline` runs both schedules and both batch layouts on a very small model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = str(Path(__file__).resolve().parents[3])


def test_bench_pipeline_prints_bubbles_and_packing_figures():
    argv = ["--pp", "2", "--vpp", "2", "--micro-batches", "1,3", "--layers", "4", "--hidden",
            "64", "--tokens", "128", "--samples", "12", "--budget", "512", "--repeats", "1"]
    proc = subprocess.run([sys.executable, "-m", "rlhf.cli", "bench", "pipeline", *argv],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    bubbles = [x for x in lines if x["kind"] == "bubble"]
    assert [(b["schedule"], b["micro_batches"]) for b in bubbles] == [
        ("1f1b", 1), ("1f1b", 3), ("interleaved", 1), ("interleaved", 3)]
    theory = {(b["vpp"], b["micro_batches"]): b["bubble_theory"] for b in bubbles}
    assert theory == {(1, 1): 0.5, (1, 3): 0.25, (2, 1): round(1 / 3, 4), (2, 3): round(1 / 7, 4)}
    for b in bubbles:
        assert 0 <= b["bubble_measured_mean"] <= b["bubble_measured_max"] < 1
        assert b["step_s"] > 0
    one_f_one_b_m3 = bubbles[1]
    assert one_f_one_b_m3["peak_held_per_stage"] == [2, 1]  # at most pp - stage
    packed, padded = [x for x in lines if x["kind"] == "packing"]
    assert (packed["mode"], padded["mode"]) == ("packed-planned", "padded")
    assert packed["padding_fraction"] == 0 and packed["tokens_computed"] == packed["real_tokens"]
    assert padded["real_tokens"] == packed["real_tokens"]
    assert padded["tokens_computed"] > padded["real_tokens"] and padded["padding_fraction"] > 0
    assert packed["micro_batches"] == padded["micro_batches"]
