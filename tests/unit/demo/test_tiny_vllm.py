"""A tiny model folder runs in a real vLLM engine and greedy-decodes like transformers. All
families' engines run one after the other in the shared vLLM interpreter
(tests/unit/rollout/vllm_interpreter.py); each case compares its own results."""

import json

import pytest
import torch

from rlhf.config.schema import TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from tests.unit.rollout.vllm_interpreter import vllm_interpreter  # noqa: F401 (a fixture)

pytestmark = pytest.mark.vllm

PROMPTS = ["12+7=", "The small model finds", "Héllo 世界, 3*4-5="]
MAX_TOKENS = 8
# Below this top-2 logit gap, fp32 rounding differences between the two engines may flip
# the greedy choice, so comparison stops there.
NEAR_TIE = 1e-4

ARCHS = ["llama", "qwen3", "gemma"]

# One "RESULT <folder>:" line per engine, so a failing family leaves the others' results.
VLLM_SCRIPT = r"""
import gc, json, sys, traceback
from vllm import LLM, SamplingParams
from rlhf.rollout import vllm_environment
prompts, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
for folder in sys.argv[3:]:
    try:
        with vllm_environment(device_type="cpu"):
            llm = LLM(model=folder, dtype="float32", max_model_len=256, enforce_eager=True,
                      seed=0, kv_cache_memory_bytes=2**26)
        result = []
        for out in llm.generate(prompts, params, use_tqdm=False):
            sample = out.outputs[0]
            result.append({"prompt_ids": list(out.prompt_token_ids),
                           "ids": list(sample.token_ids),
                           "logprobs": [lp[t].logprob
                                        for t, lp in zip(sample.token_ids, sample.logprobs)]})
        print(f"RESULT {folder}:" + json.dumps(result), flush=True)
    except Exception:
        traceback.print_exc()
    llm = None
    gc.collect()
"""


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory, vllm_interpreter):
    """Each family's tiny folder and vLLM's greedy results on it, from one interpreter."""
    base = tmp_path_factory.mktemp("tiny")
    folders = {arch: str(make_tiny_model(TinyModelConfig(arch=arch, tie_embeddings=arch != "llama"),
                                         base / arch))
               for arch in ARCHS}
    ran = vllm_interpreter.run(VLLM_SCRIPT, json.dumps(PROMPTS), str(MAX_TOKENS),
                               *map(str, folders.values()), name="tiny_vllm", timeout=400)
    return folders, ran


def _vllm_result(vllm_runs, arch):
    folders, (ok, out) = vllm_runs
    prefix = f"RESULT {folders[arch]}:"
    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    assert lines, f"vLLM failed:\n{out[-8000:]}"
    assert ok, out[-5000:]
    return folders[arch], json.loads(lines[-1].removeprefix(prefix))


@torch.no_grad()
def _hf_greedy(model, prompt_ids):
    """Greedy ids, their log-probs and the top-2 logit gap at each step (no eos stop)."""
    ids, logprobs, gaps = list(prompt_ids), [], []
    for _ in range(MAX_TOKENS):
        logits = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, 2).values
        gaps.append((top[0] - top[1]).item())
        next_id = int(logits.argmax())
        logprobs.append(torch.log_softmax(logits, dim=-1)[next_id].item())
        ids.append(next_id)
    return ids[len(prompt_ids):], logprobs, gaps


@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_greedy_matches_transformers(arch, vllm_runs, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, vllm_out = _vllm_result(vllm_runs, arch)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    compared = 0
    for prompt, got in zip(PROMPTS, vllm_out):
        prompt_ids = tokenizer(prompt)["input_ids"]
        assert got["prompt_ids"] == prompt_ids  # vLLM tokenizes with the same tokenizer
        hf_ids, hf_logprobs, gaps = _hf_greedy(model, prompt_ids)
        for step in range(MAX_TOKENS):
            if gaps[step] < NEAR_TIE:
                break
            assert got["ids"][step] == hf_ids[step], (prompt, step, got["ids"], hf_ids)
            assert got["logprobs"][step] == pytest.approx(hf_logprobs[step], abs=1e-4)
            compared += 1
    assert compared >= 2 * len(PROMPTS), f"only {compared} tokens were not near-ties"
