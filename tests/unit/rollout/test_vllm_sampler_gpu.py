"""The CUDA path of VllmSampler: chosen on a GPU rank, sleeps around training and wakes up
for a weight reload; only where CUDA (and a CUDA build of vLLM) is present."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = str(Path(__file__).resolve().parents[3])

# A fresh interpreter: vLLM changes process-wide state (the CUDA allocator under sleep mode).
SCRIPT = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from rlhf.config import RolloutConfig
from rlhf.rollout import VllmSampler, vllm_environment, sampling_params
folder = sys.argv[1]
cfg = RolloutConfig(max_new_tokens=8, gpu_memory_utilization=0.3)
with vllm_environment(device_type="cuda"):
    engine = VllmSampler(folder, config=cfg, device_type="cuda", dtype=torch.float32,
                           max_model_len=64)
params = sampling_params(cfg, greedy=True, seeds=[0])
before = engine.generate([[1, 5, 6, 7]], params)[0].token_ids
slept = engine.sleep()
assert not engine.awake
# what vLLM keeps besides weights and KV cache: measured, and small for a tiny model
assert slept.freed_bytes > 0 and 0 <= slept.residual_bytes < 4 * 2**30, slept
print(f"sleep freed {slept.freed_bytes / 2**30:.3f} GiB, "
      f"kept {slept.residual_bytes / 2**30:.3f} GiB")
free_asleep = torch.cuda.mem_get_info()[0]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
with torch.no_grad():
    for p in model.parameters():
        p.mul_(-1.0)
engine.load_weights(iter(model.state_dict().items()))
after = engine.generate([[1, 5, 6, 7]], params)[0].token_ids
engine.sleep()
assert engine.awake is False and free_asleep > 0
assert before != after, (before, after)
print("OK")
"""


def test_cuda_engine_sleeps_wakes_and_reloads(tmp_path):
    from rlhf.config import TinyModelConfig
    from rlhf.demo.tiny_model import make_tiny_model

    folder = make_tiny_model(TinyModelConfig(), tmp_path / "tiny")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-5000:]
