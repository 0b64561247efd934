"""`rlhf bench sync` and `rlhf bench rollout` run end to end on a very small model and print
one JSON line of positive figures."""

import json

import pytest

from tests.unit.bench.one_interpreter import run_benchmarks

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(500)]

SMALL = ["--layers", "1", "--hidden", "256"]  # 4 heads, 2 KV heads: tp=2 divides both


@pytest.fixture(scope="module")
def runs():
    """Both benchmarks, one after the other in one interpreter (vLLM's ranks of the first are
    processes of their own; the second builds its engine in that interpreter)."""
    sync, rollout = run_benchmarks(
        ["sync", *SMALL, "--tp", "2", "--pp", "2", "--layers", "2", "--repeats", "1",
         "--bucket-mb", "0.05"],
        ["rollout", *SMALL, "--prompts", "3", "--prompt-len", "4", "--new-tokens", "5"],
        timeout_s=480)
    return {"sync": sync, "rollout": rollout}


def one_line(run) -> dict:
    assert run.rc == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must hold one JSON line, got:\n{run.stdout[-2000:]}"
    return json.loads(lines[0])


def test_bench_sync_reports_gb_per_s_beside_memcpy_and_splits_the_time(runs):
    out = one_line(runs["sync"])
    assert (out["bench"], out["tp"], out["pp"], out["replicas"]) == ("sync", 2, 2, 4)
    assert out["bytes_per_replica"] > 0
    assert out["gb_per_s"] > 0 and out["memcpy_gb_per_s"] > 0
    ratio = out["gb_per_s"] / out["memcpy_gb_per_s"]  # each to 4 significant figures
    assert 0 < out["of_memcpy"] == pytest.approx(ratio, rel=0.05, abs=1e-3)
    assert out["gather_s"] > 0 and out["broadcast_s"] > 0 and out["reload_s"] > 0
    split = out["gather_s"] + out["broadcast_s"] + out["reload_s"]
    assert split >= out["seconds"] - 1e-3  # each part is the slowest rank's


def test_bench_rollout_reports_tokens_per_s_of_both_engines(runs):
    out = one_line(runs["rollout"])
    assert out["bench"] == "rollout" and out["new_tokens"] == 5
    assert out["vllm_tokens_per_s"] > 0 and out["transformers_tokens_per_s"] > 0
