"""`rlhf bench gap`: the planted faults change the tensors they name and nothing else, and on a
tiny Qwen2 (q/k/v biases) in bf16 a healthy sync passes the default gap limit while every
planted fault exceeds the limit of its dtype."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf.bench.gap import CASES
from rlhf.rollout.sampling import DEFAULT_GAP_LIMITS

ROOT = str(Path(__file__).resolve().parents[3])


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    names = [f"model.layers.{i}.self_attn.{p}_proj.{kind}" for i in range(2) for p in "qkvo"
             for kind in ("weight", "bias") if not (p == "o" and kind == "bias")]
    return {n: torch.randn(4, generator=gen) for n in names + ["model.norm.weight"]}


def _changed(case: str, layer: int) -> set[str]:
    weights = _weights()
    planted = CASES[case](dict(weights), layer)
    assert planted.keys() == weights.keys()
    return {n for n in weights if not torch.equal(planted[n], weights[n])}


def test_each_fault_changes_only_the_tensors_it_names():
    assert _changed("healthy", 1) == set()
    assert _changed("withheld", 1) == {n for n in _weights() if n.startswith("model.layers.1.")}
    assert _changed("swapped", 0) == {f"model.layers.0.self_attn.{p}_proj.{kind}"
                                      for p in "kv" for kind in ("weight", "bias")}
    swapped = CASES["swapped"](_weights(), 0)
    assert torch.equal(swapped["model.layers.0.self_attn.k_proj.weight"],
                       _weights()["model.layers.0.self_attn.v_proj.weight"])
    assert _changed("bias_dropped", 1) == {f"model.layers.1.self_attn.{p}_proj.bias"
                                           for p in "qkv"}
    assert not CASES["bias_dropped"](_weights(), 1)["model.layers.1.self_attn.q_proj.bias"].any()


@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_bf16_healthy_passes_the_default_and_every_planted_fault_exceeds_a_limit():
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.cli", "bench", "gap", "--dtypes", "bfloat16", "--prompts",
         "8", "--n", "2", "--new-tokens", "16"],
        capture_output=True, text=True, timeout=380, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["case"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}
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
