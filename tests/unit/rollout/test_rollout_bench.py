"""`rlhf bench sync` and `rlhf bench rollout` run end to end on a very small model and print
one JSON line of positive figures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

ROOT = str(Path(__file__).resolve().parents[3])
SMALL = ["--layers", "1", "--hidden", "256"]  # 4 heads, 2 KV heads: tp=2 divides both


def bench(command, *argv):
    proc = subprocess.run([sys.executable, "-m", "rlhf.cli", "bench", command, *SMALL, *argv],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must hold one JSON line, got:\n{proc.stdout[-2000:]}"
    return json.loads(lines[0])


def test_bench_sync_reports_gb_per_s_beside_memcpy_and_splits_the_time():
    out = bench("sync", "--tp", "2", "--pp", "2", "--layers", "2", "--repeats", "1",
                "--bucket-mb", "0.05")
    assert (out["bench"], out["tp"], out["pp"], out["replicas"]) == ("sync", 2, 2, 4)
    assert out["bytes_per_replica"] > 0
    assert out["gb_per_s"] > 0 and out["memcpy_gb_per_s"] > 0
    ratio = out["gb_per_s"] / out["memcpy_gb_per_s"]  # each to 4 significant figures
    assert 0 < out["of_memcpy"] == pytest.approx(ratio, rel=0.05, abs=1e-3)
    assert out["gather_s"] > 0 and out["broadcast_s"] > 0 and out["reload_s"] > 0
    split = out["gather_s"] + out["broadcast_s"] + out["reload_s"]
    assert split >= out["seconds"] - 1e-3  # each part is the slowest rank's


def test_bench_rollout_reports_tokens_per_s_of_both_engines():
    out = bench("rollout", "--prompts", "3", "--prompt-len", "4", "--new-tokens", "5")
    assert out["bench"] == "rollout" and out["new_tokens"] == 5
    assert out["vllm_tokens_per_s"] > 0 and out["transformers_tokens_per_s"] > 0
