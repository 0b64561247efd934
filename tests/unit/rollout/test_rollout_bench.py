"""`rlhf bench sync` and `rlhf bench rollout` run end to end on a very small model and print
one JSON line of positive figures; `rlhf bench gap` on a tiny Qwen2 (q/k/v biases) in bf16: a
healthy sync passes the default gap limit while every planted fault exceeds the limit of its
dtype."""

import json

import pytest
import torch

from rlhf.rollout.sampling import DEFAULT_GAP_LIMITS
from tests.unit.bench.one_interpreter import run_benchmarks

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(700)]

SMALL = ["--layers", "1", "--hidden", "256"]  # 4 heads, 2 KV heads: tp=2 divides both


@pytest.fixture(scope="module")
def runs():
    """The three benchmarks, one after the other in one interpreter (vLLM's ranks of the first
    and the third are processes of their own; the second builds its engine in that
    interpreter)."""
    sync, rollout, gap = run_benchmarks(
        ["sync", *SMALL, "--tp", "2", "--pp", "2", "--layers", "2", "--repeats", "1",
         "--bucket-mb", "0.05"],
        ["rollout", *SMALL, "--prompts", "3", "--prompt-len", "4", "--new-tokens", "5"],
        ["gap", "--dtypes", "bfloat16", "--prompts", "8", "--n", "2", "--new-tokens", "16"],
        timeout_s=680)
    return {"sync": sync, "rollout": rollout, "gap": gap}


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


def test_bench_gap_bf16_healthy_passes_the_default_and_every_planted_fault_exceeds_a_limit(runs):
    rows = {r["case"]: r for r in runs["gap"].json_lines()}
    assert list(rows) == ["healthy", "withheld", "swapped", "bias_dropped"]
    assert all(r["dtype"] == "bfloat16" and r["limit"] == 1.0 for r in rows.values())
    healthy = rows["healthy"]
    assert 0 < healthy["p99"] < 1.0 and not healthy["stops"], healthy  # bf16 noise, under
    assert healthy["p99"] <= healthy["max"]
    for case in ("withheld", "swapped"):
        assert rows[case]["stops"] and rows[case]["p99"] > 1.0, rows[case]
    # A dropped bias moves the bulk of tokens far less; its gap does not depend on the dtype,
    # and float32's limit, where noise is orders of magnitude smaller, catches it.
    bias = rows["bias_dropped"]["p99"]
    assert bias > DEFAULT_GAP_LIMITS[torch.float32] and bias > 2 * healthy["p99"], rows
