"""vLLM rollout tokens per second, beside a plain transformers generate loop.

Both sample the same prompts to the same length (EOS ignored) from the same model folder:
vLLM through a VllmSampler as the actor builds it, transformers with `generate` on batches
of --hf-batch prompts (all of one length, so no padding). vLLM's first call (warm-up) is not timed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from rlhf.bench.sync import tiny_model
from rlhf.config import RolloutConfig
from rlhf.engine.engine import resolve_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model folder (default: a random tiny model)")
    parser.add_argument("--prompts", type=int, default=32, help="number of prompts")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens sampled per prompt")
    parser.add_argument("--hf-batch", type=int, default=32, help="transformers batch size")
    parser.add_argument("--layers", type=int, default=4, help="tiny model: layers")
    parser.add_argument("--hidden", type=int, default=256, help="tiny model: width")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5, help="vLLM KV cache (CPU)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def run(args: argparse.Namespace) -> int:
    if min(args.prompts, args.prompt_len, args.new_tokens, args.hf_batch) < 1:
        raise SystemExit("--prompts, --prompt-len, --new-tokens and --hf-batch must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or tiny_model(Path(tmp), layers=args.layers, hidden=args.hidden)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, 500, (args.prompts, args.prompt_len), generator=gen).tolist()
        dtype = getattr(torch, args.dtype)
        vllm_s = vllm_seconds(folder, prompts, args, dtype)
        hf_s = transformers_seconds(folder, prompts, args, dtype)
    tokens = args.prompts * args.new_tokens
    print(json.dumps({
        "bench": "rollout", "prompts": args.prompts, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "device": _device().type,
        "vllm_tokens_per_s": round(tokens / vllm_s, 1),
        "transformers_tokens_per_s": round(tokens / hf_s, 1),
        "speedup": round(hf_s / vllm_s, 2),
    }), flush=True)
    return 0


def vllm_seconds(folder: str, prompts: list[list[int]], args, dtype: torch.dtype) -> float:
    """Seconds of one timed vLLM generate over all prompts (after a warm-up call)."""
    from vllm import SamplingParams

    from rlhf.rollout import VllmSampler, vllm_environment

    device = _device()
    cfg = RolloutConfig(cpu_kv_cache_gb=args.kv_cache_gb, max_new_tokens=args.new_tokens,
                        max_num_seqs=max(args.prompts, 1))
    with vllm_environment(device_type=device.type):
        engine = VllmSampler(folder, config=cfg, device_type=device.type, dtype=dtype,
                             max_model_len=args.prompt_len + args.new_tokens)
    params = [SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True,
                             seed=i, logprobs=0, detokenize=False) for i in range(len(prompts))]
    engine.generate(prompts[:2], params[:2])  # warm-up: the first steps are slow
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert sum(len(c.token_ids) for c in out) == len(prompts) * args.new_tokens
    return seconds


@torch.no_grad()
def transformers_seconds(folder: str, prompts: list[list[int]], args,
                         dtype: torch.dtype) -> float:
    """Seconds of sampling every prompt with `generate`, --hf-batch prompts at a time."""
    from transformers import AutoModelForCausalLM

    device = _device()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    model.generate(ids[:2], max_new_tokens=2, do_sample=True)  # warm-up
    start = time.perf_counter()
    for first in range(0, len(prompts), args.hf_batch):
        chunk = ids[first:first + args.hf_batch]
        out = model.generate(chunk, attention_mask=torch.ones_like(chunk), do_sample=True,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             top_k=0, pad_token_id=0)
        assert out.shape[1] == args.prompt_len + args.new_tokens
    return time.perf_counter() - start


def _device() -> torch.device:
    return resolve_device(None)  # one process, no Ray: the current GPU if any, as the engine bench
