"""A bfloat16 vLLM engine fed from a float32 source starts and syncs quietly: vLLM's
"Attempted to load weight ... with dtype torch.float32 into parameter with dtype
torch.bfloat16", once per tensor and rank, is replaced by one line of ours per engine
(rlhf/rollout/vllm_sampler.py): at the first load from a float32 folder, and none at later
syncs of float32 weights. One engine, in the shared vLLM interpreter (vllm_interpreter.py)."""

import pytest

from tests.unit.rollout.vllm_interpreter import vllm_interpreter  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCRIPT = r"""
import logging, sys, torch
from transformers import AutoModelForCausalLM
from rlhf.config import RolloutConfig
from rlhf.rollout import VllmSampler, vllm_environment, sampling_params

records = []
handler = logging.Handler(level=logging.DEBUG)
handler.emit = lambda record: records.append((record.name, record.getMessage()))
logging.getLogger().addHandler(handler)
logging.getLogger("rlhf").setLevel(logging.INFO)

def lines(phrase):
    return [m for _, m in records if phrase in m]

folder = sys.argv[1]
cfg = RolloutConfig(max_new_tokens=4, cpu_kv_cache_gb=0.05)
with vllm_environment(device_type="cpu"):
    engine = VllmSampler(folder, config=cfg, device_type="cpu", dtype=torch.bfloat16,
                         max_model_len=64)
assert lines("Attempted to load weight") == [], lines("Attempted to load weight")[:3]
ours = lines("vLLM rounds")
assert len(ours) == 1 and " float32 tensors of " in ours[0] and "engine's bfloat16" in ours[0], ours
assert int(ours[0].split()[2]) > 0, ours  # the warnings it replaced were there

weights = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
assert all(t.dtype == torch.float32 for t in weights.values())
records.clear()
engine.load_weights(iter(weights.items()))  # the trainer's float32 weights
assert lines("Attempted to load weight") == [] and lines("vLLM rounds") == [], records[:5]
params = sampling_params(cfg, greedy=True, seeds=[0])
assert len(engine.generate([[1, 5, 6]], params)[0].token_ids) > 0
print("OK", ours[0])
"""


def test_bf16_engine_from_float32_weights_is_quiet(tmp_path, vllm_interpreter):
    from rlhf.config import TinyModelConfig
    from rlhf.demo.tiny_model import make_tiny_model

    folder = make_tiny_model(TinyModelConfig(num_layers=2, hidden_size=128, num_heads=4,
                                             num_kv_heads=2, intermediate_size=256,
                                             max_position_embeddings=64), tmp_path / "fp32")
    ok, out = vllm_interpreter.run(SCRIPT, str(folder), name="bf16")
    assert ok and "OK" in out, out[-5000:]
    assert "Attempted to load weight" not in out, out[-5000:]
    print(out.splitlines()[-1])
