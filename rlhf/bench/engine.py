"""Training step of a random Llama-shaped model on this device: tokens/s, MFU, memory vs plan.

One process, no Ray or vLLM: a TrainEngine (tp = pp = dp = 1) over a one-rank gloo world
takes `--steps` timed AdamW steps over `--micro-batches` packed micro-batches of `--tokens`
tokens (sequences of `--seq-len`). JSON lines:

- "step": tokens/s and model FLOPs utilisation (3x `rlhf.bench.flops.forward_flops_per_token`:
  the matmul weights and causal attention), against the device's peak: a table of dense bf16
  peaks by GPU name on CUDA; on the CPU one thread's fp32 matmul rate measured in this run
  times the threads (so the CPU figure is relative to what torch reaches on this machine).
- "profile" (with `--profile N`): one step under torch.profiler: the N costliest ops, and the
  step's wall time split into matmul, attention, elementwise, comms and idle (the roofline's
  classes; idle = wall minus the ops' own time: the host's gaps on CUDA).
- "memory": the memory planner's prediction (rlhf.plan.memory, update phase of this one rank)
  against a measurement. CUDA: torch.cuda.max_memory_allocated over a step. CPU: the bytes of
  `TrainEngine.state_tensors()` (exact) and the bytes saved for backward by one micro-batch
  (storages caught by a saved-tensors hook, parameters excluded) against the planner's
  activations + logits. The planner models flash attention; the CPU runs an SDPA loop.
- "offload": the training state's round trip through host memory (rlhf.engine.offload, every
  switch on; pinned on CUDA): bytes, GB/s each way (the first trip allocates the host copies),
  whether sampled elements came back bit-exact, against a plain copy of one tensor between
  the device and pinned host memory measured in the same run.
- "logprobs": on the same bf16-rounded weights, the engine in bf16 and in fp32 and
  transformers in bf16 and in fp64 (the reference; fp32 without TF32): max and mean abs
  difference of the response tokens' log-probs for each pair, so bf16's gap between two
  implementations reads against each one's own distance from the exact value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from rlhf.bench.flops import PASSES, RATE_SHAPE, cpu_peak_flops, forward_flops_per_token
from rlhf.config.schema import COMPILE_CHOICES, OffloadConfig, OptimizerConfig, ParallelConfig
from rlhf.engine import MicroBatch, TrainEngine, make_micro_batches, resolve_device, resolve_dtype
from rlhf.engine.offload import Offloader
from rlhf.models.build import BuiltModel
from rlhf.models.config import ModelArgs
from rlhf.models.fused import is_fused
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
    parser.add_argument("--recompute", choices=["none", "attention_block", "full"],
                        default="none")
    parser.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="torch.compile of the elementwise work (rlhf.models.fused); auto: "
                             "on CUDA, off on the CPU, as the role configs' `compile`")
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument("--no-logprobs", action="store_true",
                        help="skip the comparison with transformers")
    parser.add_argument("--no-offload", action="store_true",
                        help="skip the offload round trip")
    parser.add_argument("--attention-kernel", default="auto",
                        choices=["auto", "sdpa_split", "torch_varlen", "flash_varlen"],
                        help="auto: the one rlhf.models.attention.pick_kernel picks; else force "
                             "one for this run (to compare kernels)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile one step (torch.profiler) and print its N costliest "
                             "kernels (device time on CUDA, CPU time elsewhere)")
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
    if args.attention_kernel != "auto":
        _force_kernel(args.attention_kernel)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model_args = _model_args(args)
    torch.manual_seed(args.seed)
    mesh = ParallelMesh([dist.get_rank()], cache=ProcessGroupCache())
    engine = TrainEngine(BuiltModel.unsharded(_random_model(model_args, device, dtype)), mesh,
                         optim=OptimizerConfig(), recompute=args.recompute, compile=args.compile)
    mbs = _micro_batches(args, model_args.vocab_size, device)
    spec = _plan_spec(model_args, dtype, args)
    lines = [{"bench": "engine", "kind": "config", "device": _device_name(device),
              "dtype": str(dtype).removeprefix("torch."), "params": _numel(engine.model),
              "layers": model_args.num_layers, "hidden": model_args.hidden_size,
              "tokens_per_step": sum(mb.num_tokens for mb in mbs), "seq_len": args.seq_len,
              "recompute": args.recompute, "compiled": is_fused(engine.model)}]
    lines.append(_time_steps(engine, mbs, args, model_args, device))
    if args.profile:
        lines.append(profile_step(engine, mbs, device, top=args.profile))
    lines.append(_memory(engine, mbs, spec, device))
    if not args.no_offload:
        lines.append(offload_round_trip(engine, device))
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
        for param in model.parameters():
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


def _step(engine: TrainEngine, mbs: list[MicroBatch], device: torch.device | None = None,
          split: list | None = None) -> None:
    """One optimizer step; with `split`, append (forward-backward s, optimizer s) to it."""
    tokens = sum(int(mb.predicts_response_T.sum()) for mb in mbs)
    start = time.perf_counter()
    engine.forward_backward(mbs, _loss_fn(tokens), outputs=("log_probs",))
    if split is not None:
        _sync(device)
        middle = time.perf_counter()
    engine.step()
    if split is not None:
        _sync(device)
        split.append((middle - start, time.perf_counter() - middle))


# Op-name fragments of each class of `profile_step`'s split, first match wins; other ops
# (norms, RoPE, activations, copies, the optimizer) are "elementwise".
OP_CLASSES = (("attention", ("attention", "flash", "fmha", "varlen")),
              ("comms", ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather",
                         "reduce_scatter", "all_to_all", "alltoall")),
              ("matmul", ("mm", "gemm", "matmul", "cutlass", "xmma", "nvjet")))
SPLIT = ("matmul", "attention", "elementwise", "comms", "idle")


def op_class(name: str) -> str:
    """The class of `profile_step`'s split an op or kernel named `name` counts in."""
    lowered = name.lower()
    return next((cls for cls, parts in OP_CLASSES if any(p in lowered for p in parts)),
                "elementwise")


def profile_step(engine: TrainEngine, mbs: list[MicroBatch], device: torch.device, *,
                 top: int) -> dict:
    """One more step under torch.profiler: the `top` ops and kernels by their own time (the
    device's on CUDA), with calls, the step's total, and the step's wall time split into
    matmul, attention, elementwise, comms and idle (wall minus the ops' time)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        _step(engine, mbs)
        _sync(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    own = (lambda e: e.self_device_time_total) if on_cuda else (lambda e: e.self_cpu_time_total)
    events = sorted(prof.key_averages(), key=own, reverse=True)
    # CUDA lists each kernel and the aten op that launched it; the op rows (CPU-side names)
    # alone add up to the device's total without counting a kernel twice.
    ops = [e for e in events if not on_cuda or e.self_cpu_time_total > 0]
    total_ms = sum(own(e) for e in ops) / 1e3
    split = dict.fromkeys(SPLIT, 0.0)
    for e in ops:
        split[op_class(e.key)] += own(e) / 1e3
    split["idle"] = max(0.0, wall_ms - total_ms)
    return {"bench": "engine", "kind": "profile", "time": "device" if on_cuda else "cpu",
            "total_ms": round(total_ms, 3), "wall_ms": round(wall_ms, 3),
            "split_ms": {k: round(v, 3) for k, v in split.items()},
            "split_share": {k: round(v / max(wall_ms, 1e-9), 4) for k, v in split.items()},
            "top": [{"name": e.key[:80], "ms": round(own(e) / 1e3, 3), "calls": e.count,
                     "share": round(own(e) / 1e3 / max(total_ms, 1e-9), 4)}
                    for e in events[:top]]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(engine, mbs, args, model_args: ModelArgs, device) -> dict:
    _step(engine, mbs)  # warm-up: allocator, kernels, optimizer state
    walls, split = [], []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        _step(engine, mbs)
        _sync(device)
        walls.append(time.perf_counter() - start)
    _step(engine, mbs, device, split)  # once more, synchronised between the two halves
    wall = statistics.median(walls)
    tokens = sum(mb.num_tokens for mb in mbs)
    flops = PASSES["update_actor"] * tokens * forward_flops_per_token(model_args,
                                                                        seq_len=args.seq_len)
    peak, source = device_peak_flops(device)
    return {"bench": "engine", "kind": "step", "step_s": round(wall, 4),
            "tokens_per_s": round(tokens / wall, 1),
            "model_tflops_per_s": _sig(flops / wall / 1e12),
            "peak_tflops_per_s": _sig(peak / 1e12) if peak else None, "peak_source": source,
            "mfu": _sig(flops / wall / peak) if peak else None,
            "micro_batches": len(mbs), "forward_backward_s": round(split[0][0], 4),
            "optimizer_step_s": round(split[0][1], 4), "attention_kernel": _kernel_name(device)}


def _kernel_name(device: torch.device) -> str:
    """The varlen attention kernel this run's model uses (rlhf.models.attention.pick_kernel)."""
    from rlhf.models import attention
    from rlhf.models.varlen_kernels import torch_varlen_fn

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return attention.pick_kernel(device.type, dtype,
                                 flash_available=attention._flash_fn() is not None,
                                 torch_varlen_available=torch_varlen_fn() is not None).__name__


def _force_kernel(name: str) -> None:
    """Make varlen_attention use kernel `name` in this (benchmark) process."""
    from rlhf.models import attention, varlen_kernels

    kernel = getattr(attention, name, None) or getattr(varlen_kernels, name)
    attention.pick_kernel = lambda *args, **kwargs: kernel


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

    return RoleSpec(name="bench", head="lm", args=model_args, parallel=ParallelConfig(), world_size=1,
                    colocated=True, dtype=dtype, trains=True, recompute=args.recompute,
                    tokens=args.tokens, shards=1, offload=OffloadConfig())


def _memory(engine: TrainEngine, mbs, spec, device: torch.device) -> dict:
    from rlhf.plan.memory import stage_memory

    (stage,) = stage_memory(spec)
    state = sum(stage.state.values())
    held = sum(t.numel() * t.element_size() for ts in engine.state_tensors().values() for t in ts)
    line = {"bench": "engine", "kind": "memory", "planned_state_bytes": state,
            "held_state_bytes": held, "planned_activation_bytes": stage.activations + stage.logits,
            "planned_layer_activation_bytes": stage.activations,
            "planned_head_bytes": stage.logits}
    head_ops = getattr(stage, "head", None)  # the planner's LM-head workspace by op, if it has one
    if head_ops:
        line["planned_head_by_op"] = dict(head_ops)
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


# ---- offload round trip -----------------------------------------------------------------------


def offload_round_trip(engine: TrainEngine, device: torch.device, *,
                       baseline_bytes: int = 2**31) -> dict:
    """The engine's whole state to the host and back twice (rlhf.engine.offload), against a
    plain device <-> pinned-host copy of min(state, `baseline_bytes`) bytes."""
    from rlhf.config.schema import OffloadConfig

    tensors = {id(t): t for ts in engine.state_tensors().values() for t in ts}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    samples = {k: _sample(t) for k, t in tensors.items()}
    trips = []
    _sync(device)
    start = time.perf_counter()
    offloader = Offloader(engine.state_tensors, config=OffloadConfig(
        params=True, grads=True, optimizer=True))  # enters "idle": everything to the host
    _sync(device)
    for _ in range(2):
        to_host = time.perf_counter() - start
        start = time.perf_counter()
        offloader.enter("update")
        _sync(device)
        trips.append((to_host, time.perf_counter() - start))
        start = time.perf_counter()
        offloader.enter("idle")
        _sync(device)
    offloader.enter("update")
    _sync(device)
    exact = all(torch.equal(_sample(t), samples[k]) for k, t in tensors.items())
    pinned = device.type == "cuda"
    line = {"bench": "engine", "kind": "offload", "bytes": total, "pinned": pinned,
            "bit_exact_samples": exact,
            "first_to_host_gb_per_s": _rate(total, trips[0][0]),
            "first_to_device_gb_per_s": _rate(total, trips[0][1]),
            "to_host_gb_per_s": _rate(total, trips[1][0]),
            "to_device_gb_per_s": _rate(total, trips[1][1])}
    # Bytes pinned (one flat buffer per kind, CUDA only) against the state, and the seconds
    # spent allocating and pinning them: the first trip's cost.
    pinned_bytes = sum(offloader.pinned_bytes.values())
    line.update({"pinned_bytes": pinned_bytes, "pinned_vs_state": pinned_bytes / total,
                 "pin_s": offloader.pin_seconds})
    line.update(plain_copy_rates(device, min(total, baseline_bytes)))
    return line


def plain_copy_rates(device: torch.device, nbytes: int) -> dict:
    """GB/s of one tensor copied device -> (pinned) host and back, the best of three."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    best = {"plain_to_host_gb_per_s": 0.0, "plain_to_device_gb_per_s": 0.0}
    for _ in range(3):
        for key, dst, source in (("plain_to_host_gb_per_s", host, src),
                                 ("plain_to_device_gb_per_s", src, host)):
            _sync(device)
            start = time.perf_counter()
            dst.copy_(source, non_blocking=True)
            _sync(device)
            best[key] = max(best[key], _rate(nbytes, time.perf_counter() - start))
    return {"plain_bytes": nbytes, **best}


def _sample(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 4096)].clone()


def _rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / max(seconds, 1e-9) / 1e9, 2)


# ---- log-probs against transformers ------------------------------------------------------------

# name -> (implementation, dtype); the last is the reference the others are measured against.
LOGPROB_RUNS = {"engine_bf16": ("engine", torch.bfloat16), "engine_fp32": ("engine", torch.float32),
                "transformers_bf16": ("transformers", torch.bfloat16),
                "transformers_fp64": ("transformers", torch.float64)}
LOGPROB_PAIRS = (("engine_bf16", "transformers_bf16"), ("engine_bf16", "transformers_fp64"),
                 ("transformers_bf16", "transformers_fp64"), ("engine_fp32", "transformers_fp64"))


def _logprobs(engine: TrainEngine, model_args: ModelArgs, mb: MicroBatch, device) -> dict:
    from rlhf.verify import ieee_fp32

    # Every model below holds exactly these values: the gaps are arithmetic, not weights.
    weights = {name: t.to(torch.bfloat16) for bucket in engine.export_hf_weights(
        bucket_bytes=2**28) for name, t in bucket}
    mask = mb.predicts_response_T
    got = {}
    with ieee_fp32():
        for name, (impl, dtype) in LOGPROB_RUNS.items():
            run = _engine_log_probs if impl == "engine" else _transformers_log_probs
            got[name] = run(weights, model_args, mb, engine.mesh, device, dtype)[mask].double()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    line = {"bench": "engine", "kind": "logprobs", "dtype": "bfloat16", "tokens": int(mask.sum()),
            "reference": "transformers_fp64"}
    for a, b in LOGPROB_PAIRS:
        diff = (got[a] - got[b]).abs()
        line[f"{a}_vs_{b}"] = {"max_abs_diff": _sig(float(diff.max())),
                               "mean_abs_diff": _sig(float(diff.mean()))}
    line["max_abs_diff"] = line["engine_bf16_vs_transformers_bf16"]["max_abs_diff"]
    line["mean_abs_diff"] = line["engine_bf16_vs_transformers_bf16"]["mean_abs_diff"]
    return line


def _engine_log_probs(weights, model_args: ModelArgs, mb: MicroBatch, mesh, device,
                      dtype) -> torch.Tensor:
    with torch.device(device):
        ours = CausalLM(model_args).to(dtype)
    ours.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    ours.tie_weights()
    return TrainEngine(BuiltModel.unsharded(ours), mesh, optim=None).forward([mb], outputs=("log_probs",))[0][
        "log_probs"]


def _transformers_log_probs(weights, model_args: ModelArgs, mb: MicroBatch, mesh, device,
                            dtype) -> torch.Tensor:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=model_args.vocab_size, hidden_size=model_args.hidden_size,
        intermediate_size=model_args.intermediate_size, num_hidden_layers=model_args.num_layers,
        num_attention_heads=model_args.num_heads, num_key_value_heads=model_args.num_kv_heads,
        max_position_embeddings=model_args.max_position_embeddings,
        rope_theta=model_args.rope_theta, rms_norm_eps=model_args.rms_norm_eps,
        tie_word_embeddings=model_args.tie_word_embeddings)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(config).to(dtype).eval()
    missing, unexpected = hf.load_state_dict({k: v.to(dtype) for k, v in weights.items()},
                                             strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not map onto transformers: missing {missing}, "
                           f"unexpected {unexpected}")
    hf.tie_weights()
    return _hf_log_probs(hf, mb)


@torch.no_grad()
def _hf_log_probs(hf, mb: MicroBatch) -> torch.Tensor:
    """(T,) log-prob of each next token from transformers, sequence by sequence, in fp64 from
    the model's own logits."""
    out = torch.zeros(mb.num_tokens, device=mb.packed.tokens.device, dtype=torch.float64)
    bounds = mb.packed.cu_seqlens.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        ids = mb.packed.tokens[start:stop]
        logits = hf(input_ids=ids[None]).logits[0].double()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
        out[start:stop - 1] = lp
    return out
