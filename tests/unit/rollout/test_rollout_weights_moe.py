"""Weight sync of a Qwen3-MoE policy into vLLM's fused MoE layout on the CPU
(rlhf/rollout/weights.py): HF-named expert weights, per expert (as Qwen3-MoE checkpoints name
them) or stacked (as transformers holds them), streamed in small buckets, land in the fused
w13/w2 tensors and vLLM's repacked CPU kernel so that vLLM matches transformers; reloading the
old weights gives bit for bit what vLLM's own loading gave; a sync missing one expert's piece
is refused, naming the fused module. One engine, in the shared vLLM interpreter
(vllm_interpreter.py)."""

from pathlib import Path

import pytest

from tests.unit.rollout.vllm_interpreter import vllm_interpreter  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCRIPT = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from rlhf.config import RolloutConfig
from rlhf.models.hf_io import bucketed
from rlhf.rollout import VllmSampler, vllm_environment, sampling_params
from rlhf.rollout.weights import DirectReload, IncompleteSyncError

old, new = sys.argv[1], sys.argv[2]
cfg = RolloutConfig(max_new_tokens=6, cpu_kv_cache_gb=0.05)
with vllm_environment(device_type="cpu"):
    engine = VllmSampler(old, config=cfg, device_type="cpu", dtype=torch.float32,
                         max_model_len=64)
prompts = [[1, 5, 6, 7], [3, 4], [9, 8, 7, 6, 5]]
params = sampling_params(cfg, greedy=True, seeds=[0, 1, 2])

def generate():
    return [(c.token_ids, c.log_probs) for c in engine.generate(prompts, params)]

def per_expert(named):
    # transformers stacks experts ([E, 2I, H] gate|up, [E, H, I] down); checkpoints name each
    for name, t in named:
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                yield name.replace("gate_up_proj", f"{e}.gate_proj.weight"), gate[e]
                yield name.replace("gate_up_proj", f"{e}.up_proj.weight"), up[e]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                yield name.replace("down_proj", f"{e}.down_proj.weight"), t[e]
        else:
            yield name, t

def stream(named, bucket_bytes=20_000):  # buckets split a layer's experts (the sync's shape)
    for bucket in bucketed(named, bucket_bytes):
        yield from bucket

def gap_to(model, outs):
    gap = 0.0
    for prompt, (tokens, log_probs) in zip(prompts, outs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits, -1)
        assert logp.argmax(-1).tolist() == tokens, (logp.argmax(-1).tolist(), tokens)
        ref = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        gap = max(gap, (ref - torch.tensor(log_probs)).abs().max().item())
    return gap

assert engine.llm.collective_rpc(lambda w: DirectReload.supports(w.model_runner.model)) == [True]
before = generate()
old_model = AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32)
new_model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32)
old_named = list(old_model.state_dict().items())
new_named = list(new_model.state_dict().items())

engine.load_weights(stream(per_expert(new_named)))
direct = generate()
moved = max(abs(a - b) for (_, x), (_, y) in zip(before, direct) for a, b in zip(x, y))
assert moved > 1e-2, f"the reload changed nothing ({moved})"
gap = gap_to(new_model, direct)
assert gap < 2e-4, gap

engine.load_weights(stream(old_named))  # stacked names
assert generate() == before, "a reload of the old weights differs from vLLM's own loading"

dropped = "model.layers.1.mlp.experts.3.up_proj.weight"
try:
    engine.load_weights(stream(w for w in per_expert(new_named) if w[0] != dropped))
except IncompleteSyncError as e:
    assert "1 vLLM module(s)" in str(e) and "model.layers.1.mlp.experts.routed_experts" in str(e), e
else:
    raise AssertionError("a sync without one expert's up_proj was accepted")
engine.load_weights(stream(per_expert(old_named)))
assert generate() == before, "a complete sync after a refused one differs"
print("OK", gap)
"""


def make_moe(folder: Path, seed: int) -> str:
    """A tiny random Qwen3-MoE folder: 8 experts, top-2, an expert width vLLM's CPU kernel pads
    (so a layout slip shows)."""
    from rlhf.config import TinyModelConfig
    from rlhf.demo.tiny_model import make_tiny_model

    spec = TinyModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=128, num_heads=4,
                           num_kv_heads=2, intermediate_size=192, max_position_embeddings=64,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                           tie_embeddings=False, seed=seed)
    return str(make_tiny_model(spec, folder))


def test_moe_sync_into_fused_layout(tmp_path, vllm_interpreter):
    old, new = make_moe(tmp_path / "old", 0), make_moe(tmp_path / "new", 1)
    ok, out = vllm_interpreter.run(SCRIPT, old, new, name="moe")
    assert ok and "OK" in out, out[-5000:]
