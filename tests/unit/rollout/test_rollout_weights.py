"""Weight reload into a live vLLM CPU engine by the direct path (rlhf/rollout/weights.py): it
matches transformers on the new weights, reloading the old ones gives bit for bit what vLLM's
own loading gave (a tied LM head included), it equals vLLM's layer-wise reload, and it
refuses a sync that leaves any module short of its weights (a whole layer, one of the q/k/v
pieces of a stacked module, a norm), naming the modules. The engine is built inside
`vllm_environment`, and generates and syncs after the environment is restored. Both models'
engines run one after the other in the shared vLLM interpreter (vllm_interpreter.py); each
case asserts its own line of that run."""

import pytest

from tests.unit.rollout.vllm_interpreter import vllm_interpreter  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCRIPT = r"""
import os, sys, torch, traceback
from transformers import AutoModelForCausalLM
from rlhf.config import RolloutConfig
from rlhf.rollout import VllmSampler, vllm_environment, sampling_params
from rlhf.rollout.weights import DirectReload, IncompleteSyncError, _layerwise_reload


def check(old, new):
    cfg = RolloutConfig(max_new_tokens=6, cpu_kv_cache_gb=0.05)
    ours = {"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_CONFIGURE_LOGGING", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM"}
    for key in ours:
        os.environ.pop(key, None)
    with vllm_environment(device_type="cpu"):
        engine = VllmSampler(old, config=cfg, device_type="cpu", dtype=torch.float32,
                             max_model_len=64)
    assert not ours & set(os.environ), ours & set(os.environ)  # restored: the engine runs on
    prompts = [[1, 5, 6, 7], [3, 4], [9, 8, 7, 6, 5]]
    params = sampling_params(cfg, greedy=True, seeds=[0, 1, 2])

    def generate():
        return [(c.token_ids, c.log_probs) for c in engine.generate(prompts, params)]

    def hf_weights(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tied = model.config.tie_word_embeddings
        return model, [(n, t) for n, t in model.state_dict().items()
                       if not (tied and n == "lm_head.weight")]

    def layerwise(worker, weights):
        _layerwise_reload(worker.model_runner.model, weights, worker.model_runner.model_config)

    def uses_direct(worker):
        return DirectReload.supports(worker.model_runner.model)

    assert engine.llm.collective_rpc(uses_direct) == [True]
    before = generate()  # vLLM's own loading of the old folder
    new_model, new_weights = hf_weights(new)
    _, old_weights = hf_weights(old)
    engine.load_weights(iter(new_weights))  # the direct path
    direct = generate()
    moved = max(abs(a - b) for (_, x), (_, y) in zip(before, direct) for a, b in zip(x, y))
    assert moved > 1e-2, f"the reload changed nothing ({moved})"

    # transformers on the new weights: greedy tokens and their log-probs
    gap = 0.0
    for prompt, (tokens, log_probs) in zip(prompts, direct):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logp = torch.log_softmax(new_model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
        assert logp.argmax(-1).tolist() == tokens, (logp.argmax(-1).tolist(), tokens)
        ref = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        gap = max(gap, (ref - torch.tensor(log_probs)).abs().max().item())
    assert gap < 2e-4, gap

    # back to the old weights: bit for bit what vLLM's own loading gave (the LM head included)
    engine.load_weights(iter(old_weights))
    assert generate() == before, "a direct reload of the old weights differs from loading them"

    # a sync that misses modules is refused, naming them: a whole layer, then one piece of a
    # stacked module and a norm (modules that received part of their elements, or were never
    # counted before)
    try:
        engine.load_weights(iter([w for w in new_weights if ".layers.1." not in w[0]]))
    except IncompleteSyncError as e:
        assert "model.layers.1.self_attn.qkv_proj 0/" in str(e), e
    else:
        raise AssertionError("a sync without layer 1 was accepted")
    dropped = ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.input_layernorm.weight")
    try:
        engine.load_weights(iter([w for w in new_weights if w[0] not in dropped]))
    except IncompleteSyncError as e:
        message = str(e)
        assert "2 vLLM module(s)" in message, message
        assert "model.layers.1.self_attn.qkv_proj" in message, message
        assert "model.layers.0.input_layernorm 0/128" in message, message
    else:
        raise AssertionError("a sync without k_proj of layer 1 and a norm was accepted")
    engine.load_weights(iter(new_weights))  # a complete sync after refused ones
    assert generate() == direct, "a complete sync after refused ones differs"

    # Last: a direct reload after a layer-wise one gives NaN on the CPU (either never follows the
    # other in a job: the path depends on the model). A tied LM head's packed kernel follows its
    # embedding on the layer-wise path too (vLLM's own reload would leave it stale).
    engine.llm.collective_rpc(layerwise, args=(iter(new_weights),))
    assert generate() == direct, "direct and layer-wise reloads differ"
    print("OK", old, flush=True)


for old, new in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        check(old, new)
    except Exception:  # the other model's case still runs and reports
        traceback.print_exc()
        print("FAILED", old, flush=True)
"""


CASES = {"llama": False, "qwen2": True}  # arch: tied LM head


@pytest.fixture(scope="module")
def run(tmp_path_factory, vllm_interpreter):
    """Both cases' engines, one after the other: the run's output and each case's old-weights
    folder."""
    from rlhf.config import TinyModelConfig
    from rlhf.demo.tiny_model import make_tiny_model

    folders = {}
    for arch, tied in CASES.items():
        spec = dict(arch=arch, tie_embeddings=tied, num_layers=2, hidden_size=128, num_heads=4,
                    num_kv_heads=2, intermediate_size=256, max_position_embeddings=64)
        base = tmp_path_factory.mktemp(arch)
        folders[arch] = [str(make_tiny_model(TinyModelConfig(**spec, seed=seed), base / name))
                         for seed, name in ((0, "old"), (1, "new"))]
    ran = vllm_interpreter.run(SCRIPT, *sum(folders.values(), []), name="weights")
    return ran, {arch: old for arch, (old, _) in folders.items()}


@pytest.mark.parametrize("arch", sorted(CASES))
def test_direct_reload_equals_layerwise_and_transformers(run, arch):
    (ok, out), old = run
    assert f"OK {old[arch]}\n" in out, out[-7000:]
    assert ok, out[-5000:]
