"""Training step of a random Llama-shaped model on this device: tokens/s, MFU, memory vs plan.

One process, no Ray or vLLM: a TrainEngine (tp = pp = dp = 1) over a one-rank gloo world
takes `--steps` timed AdamW steps over `--micro-batches` packed micro-batches of `--tokens`
tokens (sequences of `--seq-len`). JSON lines:

- "step": tokens/s and model FLOPs utilisation (3x `rlhf.bench.flops.forward_flops_per_token`:
  the matmul weights and causal attention), against the device's peak: a table of dense bf16
  peaks by GPU name on CUDA; on the CPU one thread's fp32 matmul rate measured in this run
  times the threads (so the CPU figure is relative to what torch reaches on this machine).
- "memory": the memory planner's prediction (rlhf.plan.memory, update phase of this one rank)
  against a measurement. CUDA: torch.cuda.max_memory_allocated over a step. CPU: the bytes of
  `TrainEngine.state_tensors()` (exact) and the bytes saved for backward by one micro-batch
  (storages caught by a saved-tensors hook, parameters excluded) against the planner's
  activations + logits. The planner models flash attention; the CPU runs an SDPA loop.
- "logprobs": the model in bf16 (a forward-only engine) against transformers in bf16 on the
  same weights: max and mean abs difference of the response tokens' log-probs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from rlhf.bench.flops import PASSES, RATE_SHAPE, cpu_peak_flops, forward_flops_per_token
from rlhf.config.roles import OffloadConfig, OptimizerConfig, ParallelConfig
from rlhf.engine import MicroBatch, TrainEngine, make_micro_batches, resolve_device, resolve_dtype
from rlhf.models.config import ModelArgs
from rlhf.models.transformer import CausalLM
from rlhf.parallel.launch import free_port
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache

# name -> (layers, hidden, heads, kv_heads, intermediate, vocab, tied): Llama-family shapes.
SIZES = {
    "tiny": (2, 128, 4, 2, 256, 512, False),
    "125m": (12, 768, 12, 4, 2048, 32000, True),
    "1b": (16, 2048, 32, 8, 8192, 128256, True),  # Llama-3.2-1B
    "8b": (32, 4096, 32, 8, 14336, 128256, False),  # Llama-3-8B
}
# Dense bf16 tensor-core peaks (FLOP/s) by a substring of torch.cuda.get_device_name();
# the first match wins, so the more specific names come first.
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
             ("A100", 312e12))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny",
                        help="a model shape; --layers etc. override its numbers")
    for flag in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab"):
        parser.add_argument(f"--{flag}", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--micro-batches", type=int, default=2, help="per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument("--no-logprobs", action="store_true",
                        help="skip the comparison with transformers")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.seq_len > args.tokens:
        raise SystemExit(f"error: --seq-len {args.seq_len} exceeds --tokens {args.tokens}; one "
                         "sequence must fit a micro-batch")
    owner = not dist.is_initialized()
    if owner:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    try:
        for line in bench(args):
            print(json.dumps(line), flush=True)
    finally:
        if owner:
            dist.destroy_process_group()
    return 0


def bench(args: argparse.Namespace) -> list[dict]:
    """Every JSON line of the benchmark (see the module docstring)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model_args = _model_args(args)
    torch.manual_seed(args.seed)
    mesh = ParallelMesh([dist.get_rank()], cache=ProcessGroupCache(), device_type=device.type)
    engine = TrainEngine(_random_model(model_args, device, dtype), mesh, optim=OptimizerConfig(),
                         recompute=args.recompute)
    mbs = _micro_batches(args, model_args.vocab_size, device)
    spec = _plan_spec(model_args, dtype, args)
    lines = [{"bench": "engine", "kind": "config", "device": _device_name(device),
              "dtype": str(dtype).removeprefix("torch."), "params": _numel(engine.model),
              "layers": model_args.num_layers, "hidden": model_args.hidden_size,
              "tokens_per_step": sum(mb.num_tokens for mb in mbs), "seq_len": args.seq_len,
              "recompute": args.recompute}]
    lines.append(_time_steps(engine, mbs, args, model_args, device))
    lines.append(_memory(engine, mbs, spec, device))
    if not args.no_logprobs:
        lines.append(_logprobs(engine, model_args, mbs[0], device))
    return lines


# ---- model and data ----------------------------------------------------------------------------


def _model_args(args) -> ModelArgs:
    layers, hidden, heads, kv, inter, vocab, tied = SIZES[args.size]
    pick = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv,
            "intermediate": inter, "vocab": vocab}
    pick = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in pick.items()}
    return ModelArgs.from_hf_config(dict(
        model_type="llama", vocab_size=pick["vocab"], hidden_size=pick["hidden"],
        intermediate_size=pick["intermediate"], num_hidden_layers=pick["layers"],
        num_attention_heads=pick["heads"], num_key_value_heads=pick["kv_heads"],
        max_position_embeddings=max(args.seq_len, 2048), tie_word_embeddings=tied,
        rope_theta=500000.0))


def _random_model(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> CausalLM:
    with torch.device(device):
        model = CausalLM(args)
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # norms keep their ones
                torch.nn.init.normal_(param, std=0.02)
    return model.to(dtype)


def _micro_batches(args, vocab: int, device: torch.device) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(args.seed)
    per_mb = args.tokens // args.seq_len
    prompt = max(1, args.seq_len // 4)
    n = per_mb * args.micro_batches
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen) for _ in range(n)]
    responses = [torch.randint(0, vocab, (args.seq_len - prompt,), generator=gen)
                 for _ in range(n)]
    mbs = make_micro_batches(prompts, responses, max_tokens=args.tokens)
    return [mb.to(device) for mb in mbs]


def _loss_fn(global_tokens: int):
    def loss_fn(out, mb: MicroBatch):
        return -(out["log_probs"] * mb.predicts_response_T).sum() / global_tokens, {}
    return loss_fn


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---- speed -------------------------------------------------------------------------------------


def _step(engine: TrainEngine, mbs: list[MicroBatch]) -> None:
    tokens = sum(int(mb.predicts_response_T.sum()) for mb in mbs)
    engine.forward_backward(mbs, _loss_fn(tokens), outputs=("log_probs",))
    engine.step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(engine, mbs, args, model_args: ModelArgs, device) -> dict:
    _step(engine, mbs)  # warm-up: allocator, kernels, optimizer state
    walls = []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        _step(engine, mbs)
        _sync(device)
        walls.append(time.perf_counter() - start)
    wall = statistics.median(walls)
    tokens = sum(mb.num_tokens for mb in mbs)
    flops = PASSES["update_actor"] * tokens * forward_flops_per_token(model_args,
                                                                        seq_len=args.seq_len)
    peak, source = device_peak_flops(device)
    return {"bench": "engine", "kind": "step", "step_s": round(wall, 4),
            "tokens_per_s": round(tokens / wall, 1),
            "model_tflops_per_s": _sig(flops / wall / 1e12),
            "peak_tflops_per_s": _sig(peak / 1e12) if peak else None, "peak_source": source,
            "mfu": _sig(flops / wall / peak) if peak else None}


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def device_peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s, where it comes from): the bf16 table on CUDA, a measured matmul on CPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_BF16:
            if key in name:
                return peak, f"dense bf16 peak of {key} (datasheet)"
        return None, f"no peak known for {name!r}; MFU not computed"
    threads = torch.get_num_threads()
    return (cpu_peak_flops(threads),
            f"measured: one thread's fp32 {RATE_SHAPE}x{RATE_SHAPE} matmul in this run x {threads} "
            "threads")


# ---- memory ------------------------------------------------------------------------------------


def _plan_spec(model_args: ModelArgs, dtype: torch.dtype, args):
    from rlhf.plan.inputs import RoleSpec

    return RoleSpec(name="bench", head="lm", args=model_args, plan=ParallelConfig(), world_size=1,
                    colocated=True, dtype=dtype, trains=True, recompute=args.recompute,
                    tokens=args.tokens, shards=1, offload=OffloadConfig())


def _memory(engine: TrainEngine, mbs, spec, device: torch.device) -> dict:
    from rlhf.plan.memory import stage_memory

    (stage,) = stage_memory(spec)
    state = sum(stage.state.values())
    held = sum(t.numel() * t.element_size() for ts in engine.state_tensors().values() for t in ts)
    line = {"bench": "engine", "kind": "memory", "planned_state_bytes": state,
            "held_state_bytes": held, "planned_activation_bytes": stage.activations + stage.logits}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        _step(engine, mbs)
        _sync(device)
        measured = torch.cuda.max_memory_allocated(device)
        planned = state + stage.activations + stage.logits  # the update phase of this rank
        line.update(measured="torch.cuda.max_memory_allocated over one step",
                    planned_peak_bytes=planned, measured_peak_bytes=measured,
                    peak_ratio=round(measured / planned, 4))
    else:
        saved = saved_for_backward_bytes(engine, mbs[0])
        line.update(measured="bytes saved for backward by one micro-batch (CPU, SDPA loop)",
                    measured_activation_bytes=saved,
                    activation_ratio=round(saved / max(1, line["planned_activation_bytes"]), 4))
    return line


def saved_for_backward_bytes(engine: TrainEngine, mb: MicroBatch) -> int:
    """Bytes of the distinct storages autograd saves over one micro-batch's forward, the
    parameters' own storages excluded (they are state, not activations)."""
    params = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.forward_backward([mb], _loss_fn(max(1, int(mb.predicts_response_T.sum()))),
                                outputs=("log_probs",))
    engine.zero_grad()
    return sum(seen.values())


# ---- log-probs against transformers ------------------------------------------------------------


def _logprobs(engine: TrainEngine, model_args: ModelArgs, mb: MicroBatch, device) -> dict:
    import transformers

    weights = {name: t.to(torch.bfloat16) for bucket in engine.export_hf_weights(
        bucket_bytes=2**28) for name, t in bucket}
    ours = CausalLM(model_args).to(device=device, dtype=torch.bfloat16)
    ours.load_state_dict(weights, strict=False)
    ours.tie_weights()
    mesh = engine.mesh
    ours_lp = TrainEngine(ours, mesh, optim=None).forward([mb], outputs=("log_probs",))[0]
    config = transformers.LlamaConfig(
        vocab_size=model_args.vocab_size, hidden_size=model_args.hidden_size,
        intermediate_size=model_args.intermediate_size, num_hidden_layers=model_args.num_layers,
        num_attention_heads=model_args.num_heads, num_key_value_heads=model_args.num_kv_heads,
        max_position_embeddings=model_args.max_position_embeddings,
        rope_theta=model_args.rope_theta, rms_norm_eps=model_args.rms_norm_eps,
        tie_word_embeddings=model_args.tie_word_embeddings)
    hf = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not map onto transformers: missing {missing}, "
                           f"unexpected {unexpected}")
    hf.tie_weights()
    want = _hf_log_probs(hf, mb)
    mask = mb.predicts_response_T
    diff = (ours_lp["log_probs"][mask].float() - want[mask]).abs()
    return {"bench": "engine", "kind": "logprobs", "dtype": "bfloat16", "tokens": int(mask.sum()),
            "max_abs_diff": round(float(diff.max()), 5),
            "mean_abs_diff": round(float(diff.mean()), 6)}


@torch.no_grad()
def _hf_log_probs(hf, mb: MicroBatch) -> torch.Tensor:
    """(T,) log-prob of each next token from transformers, sequence by sequence, fp32."""
    out = torch.zeros(mb.num_tokens, device=mb.packed.tokens.device)
    bounds = mb.packed.cu_seqlens.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        ids = mb.packed.tokens[start:stop]
        logits = hf(input_ids=ids[None]).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
        out[start:stop - 1] = lp
    return out
