"""MoE experts: our grouped GEMMs and expert loop against transformers' own implementations.

One Qwen3-MoE sparse block (router plus routed experts) of `--experts` experts, top `--top-k`,
written by transformers and loaded into ours, takes a forward and backward of `--tokens`
tokens. Timed, each the median of `--repeats` after a warm-up, all interleaved in one run:

- "ours_grouped_stacked": `SparseMoeBlock` with `torch._grouped_mm` over its experts' weights
  stored stacked (`rlhf.models.moe.stack_expert_weights`, as the engine leaves them): views,
  no copy forward or backward (its path on CUDA);
- "ours_grouped": the same grouped GEMMs over weights stored apart, so stacked by a copy in
  forward and again in backward (the path before the engine stacked them);
- "ours_loop": the same block, one expert at a time (its path on the CPU);
- "transformers_<impl>": transformers' `Qwen3MoeSparseMoeBlock` with each of its training experts
  implementations that runs here (`eager`, its loop; `grouped_mm`, over weights it stores
  stacked: the baseline, what a user of transformers would pick).

JSON lines: one "agreement" line per path of ours (output, input and router grads against
transformers' eager block, relative to its largest magnitude; `passed` under the dtype's
tolerance) and one "speed" line per implementation with `ms`, `baseline_ms` and `ratio` (ms over
the baseline's); `chosen` marks the path `rlhf.models.moe.runs_grouped` takes here.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from rlhf.bench import print_checked
from rlhf.engine import resolve_device
from rlhf.models.moe import runs_grouped, stack_expert_weights

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # of the largest magnitude


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256, help="each expert's")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    return print_checked(bench(args))


def bench(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    dtype = _dtype(args.dtype, device)
    ours, hf_model = _blocks(args, device, dtype)
    x_TH = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(
        args.seed)).to(device, dtype)
    shape = {"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
             "intermediate": args.intermediate, "tokens": args.tokens,
             "dtype": str(dtype).removeprefix("torch."), "device": device.type}
    grouped_here = runs_grouped(x_TH, ours.local_experts()[0].gate_proj.weight)
    stacked = copy.deepcopy(ours)
    if not stack_expert_weights(stacked.local_experts()):
        raise RuntimeError("the block's experts could not be stacked")
    runners = {"ours_grouped_stacked": _ours(stacked, grouped=True),
               "ours_grouped": _ours(ours, grouped=True), "ours_loop": _ours(ours, grouped=False)}
    for impl in _transformers_implementations(hf_model):
        runners[f"transformers_{impl}"] = _transformers(hf_model, impl)
    lines = [{"bench": "experts", "kind": "agreement", "implementation": name, **shape,
              **_agreement(runners[name], runners["transformers_eager"], x_TH, dtype)}
             for name in ("ours_grouped_stacked", "ours_grouped", "ours_loop")]
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step in runners.values():  # warm-up
        step(x_TH)
    for _ in range(args.repeats):  # interleaved, so the machine's load falls on every one
        for name, step in runners.items():
            times[name].append(_timed(step, x_TH, device))
    baseline = "transformers_grouped_mm" if "transformers_grouped_mm" in times \
        else "transformers_eager"
    baseline_ms = statistics.median(times[baseline])
    for name, samples in times.items():
        ms = statistics.median(samples)
        lines.append({"bench": "experts", "kind": "speed", "implementation": name, **shape,
                      "ms": round(ms, 3), "baseline": baseline,
                      "baseline_ms": round(baseline_ms, 3), "ratio": round(ms / baseline_ms, 3),
                      # the engine stacks the experts, so CUDA's grouped path is the stacked one
                      "chosen": name == ("ours_grouped_stacked" if grouped_here
                                         else "ours_loop")})
    return lines


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    if dtype not in TOLERANCE:
        raise ValueError(f"--dtype {name}: use one of auto, {', '.join(map(str, TOLERANCE))}")
    return dtype


def _blocks(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(our SparseMoeBlock, transformers' one-layer model) with the same weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from rlhf.config.schema import TinyModelConfig
    from rlhf.demo.tiny_model import _init_weights, tiny_hf_config
    from rlhf.models.config import ModelArgs
    from rlhf.models.hf_io import load_hf_weights
    from rlhf.models.moe import SparseMoeBlock, split_fused_experts
    from rlhf.models.transformer import CausalLM

    spec = TinyModelConfig(arch="qwen3_moe", num_layers=1, hidden_size=args.hidden,
                           num_heads=4, num_kv_heads=2, intermediate_size=args.intermediate,
                           vocab_size=384, max_position_embeddings=64,
                           num_experts=args.experts, num_experts_per_tok=args.top_k,
                           moe_intermediate_size=args.intermediate)
    config = tiny_hf_config(spec, bos_id=0, eos_id=1, pad_id=2)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(hf, seed=args.seed)
    with tempfile.TemporaryDirectory() as folder:
        save_file(split_fused_experts({k: v.contiguous() for k, v in hf.state_dict().items()}),
                  f"{folder}/model.safetensors", metadata={"format": "pt"})
        config.architectures = ["Qwen3MoeForCausalLM"]
        config.save_pretrained(folder)
        ours = CausalLM(ModelArgs.from_pretrained(folder))
        load_hf_weights(ours, folder)
    block = ours.model.layers["0"].mlp.to(device, dtype)
    assert isinstance(block, SparseMoeBlock)
    return block, hf.to(device, dtype)


def _ours(block, *, grouped: bool) -> Callable[[torch.Tensor], tuple]:
    from unittest import mock

    from rlhf.models.moe import Routing

    def step(x_TH):
        with mock.patch("rlhf.models.moe.runs_grouped", lambda x, w: grouped):
            x = x_TH.detach().requires_grad_()
            out = block(x, Routing(num_tokens=x.shape[0]))
            out.float().square().mean().backward()
        grads = (x.grad, block.gate.weight.grad)
        block.zero_grad(set_to_none=True)
        return out.detach(), *grads

    return step


def _transformers(hf, impl: str) -> Callable[[torch.Tensor], tuple]:
    block = hf.model.layers[0].mlp

    def step(x_TH):
        hf.set_experts_implementation(impl)
        x = x_TH.detach().requires_grad_()
        out = block(x[None])[0]
        out.float().square().mean().backward()
        grads = (x.grad, block.gate.weight.grad)
        block.zero_grad(set_to_none=True)
        return out.detach(), *grads

    return step


def _transformers_implementations(hf) -> list[str]:
    """The experts implementations transformers runs here, eager first. Not its batched_mm:
    it gathers a weight copy per routed token (gigabytes at this shape), an inference path."""
    found = []
    for impl in ("eager", "grouped_mm"):
        try:
            hf.set_experts_implementation(impl)
        except (ValueError, ImportError, RuntimeError):
            continue
        found.append(impl)
    return found


def _agreement(ours, reference, x_TH, dtype) -> dict:
    got, want = ours(x_TH), reference(x_TH)
    errors = {name: float((g.float() - w.float()).abs().max() / w.float().abs().max())
              for name, g, w in zip(("out", "dx", "d_router"), got, want)}
    return {"relative_error": {k: round(v, 8) for k, v in errors.items()},
            "tolerance": TOLERANCE[dtype], "passed": max(errors.values()) <= TOLERANCE[dtype]}


def _timed(step, x_TH, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(x_TH)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3

