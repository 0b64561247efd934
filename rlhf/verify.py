"""`rlhf verify-model`: a model folder in a parallel layout against transformers, numerically.

The parent process draws a seeded packed batch and runs transformers' AutoModelForCausalLM
twice, one sequence at a time: in float64 (the reference) and in float32. Each gives logits,
next-token log-probs, entropy and the gradients of one loss (mean next-token log-prob plus mean
entropy). N gloo processes then build the model with `build_model` in the requested layout
(dp = N / (tp * cp * pp) replicas, each running the whole batch, its loss scaled by 1/dp; with ep > 1
the dp replicas of an ep group split every MoE layer's experts), run the
engine's forward (`model_outputs`), backward and the training grad sync (`TrainEngine.sync_grads`:
TP, pipeline ties, DP, ZeRO-1 when dp > 1), and measure their distance to the reference: logits
gathered over the vocabulary for this check only, grads gathered to full.
With pp > 1 the batch runs as micro-batches of two sequences through the engine's pipeline
schedule (1F1B, or interleaved with vpp > 1); logits stay on the last stage, so log-probs,
entropy and grads are compared and "logits" is left out of the report. With cp > 1 the same
micro-batches (an MoE model: the one micro-batch below) run through the engine's schedule on
each cp rank's shard of their tokens (rlhf.engine.rank_stream), log-probs and entropy gathered
back; no logits either.

The rule: fp32 rounding on a real checkpoint moves logits and grads far more than on a tiny
random model, so no fixed tolerance fits both. Ours passes when, for each quantity (and for each
parameter's grad), its max abs error against float64 is at most `factor` times transformers' own
float32 error plus `floor`. A real bug (a wrong RoPE base or norm epsilon, a mis-sharded
weight) moves results by orders of magnitude more than rounding does.

A mixture-of-experts model (qwen3_moe) also checks the routers: the loss adds
MOE_AUX_WEIGHT x transformers' load-balancing loss (pp = 1: the engine adds its own, over one
micro-batch of the whole batch, so the routers' grads include it) and "aux_loss" is compared
as a quantity; with pp > 1, where the engine refuses the aux loss, the loss leaves it out.

With `device="cuda"` the ranks are NCCL processes, one per GPU (by default one per visible
GPU), both references run on the first GPU, and fp32 matmuls are IEEE on both sides (TF32 off,
`ieee_fp32`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from rlhf.config.schema import (
    COMPILE_CHOICES,
    Compile,
    CpAttention,
    OptimizerConfig,
    ParallelConfig,
)
from rlhf.data.packing import pack, pack_prompt_response, shifted_targets
from rlhf.engine.engine import TrainEngine
from rlhf.engine.micro_batch import MicroBatch
from rlhf.errors import RLHFError
from rlhf.models.build import build_model
from rlhf.models.config import ModelArgs
from rlhf.models.moe import split_fused_experts
from rlhf.models.outputs import LM_OUTPUTS, forward_packed, model_outputs, vocab_shard
from rlhf.models.tp_sharding import check_tp_compatible
from rlhf.parallel.collectives import all_gather
from rlhf.parallel.fusion import compile_enabled
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.parallel.stages import split_layers

# Compared value by value (aux_loss: MoE models only); grads per parameter.
OUTPUTS = ("logits", "log_probs", "entropy", "aux_loss")
MOE_AUX_WEIGHT = 1.0  # large enough that the aux loss's share of the routers' grads is checked
# Ours may be this many times further from float64 than transformers' float32 is: both add the
# same terms in another order (sharded sums, packed attention), so their errors are alike.
DEFAULT_FACTOR = 4.0
# Plus this much absolute error, for values that float32 happens to get exactly (a norm weight's
# grad on a tiny model), where any other summation order is "infinitely" worse; larger on a GPU,
# whose kernels (cuBLAS split-K, fused SDPA) add in orders that differ from run to run.
DEFAULT_FLOOR = {"cpu": 1e-6, "cuda": 1e-5}


def verify_model(folder: str | Path, *, tp: int, pp: int = 1, vpp: int = 1,
                 sequence_parallel: bool = False, ep: int = 1, cp: int = 1,
                 cp_attention: CpAttention = "all_gather", nproc: int | None = None,
                 factor: float = DEFAULT_FACTOR, floor: float | None = None,
                 reference: str | Path | None = None, seed: int = 0, num_seqs: int = 6,
                 max_len: int = 48, timeout_s: float = 600.0, device: str = "cpu",
                 compile: Compile = "auto") -> dict:
    """Run the comparison on `device` ("cpu": gloo; "cuda": NCCL, a GPU per process); return
    the report (`passed`: every error within `factor` x transformers' fp32 error + `floor`).
    `reference` is the folder transformers loads (default `folder`). `compile`: the engine's
    fused elementwise bodies (`rlhf.models.fused`; auto: on CUDA only, as in training)."""
    folder = Path(folder)
    reference = folder if reference is None else Path(reference)
    if device not in DEFAULT_FLOOR:
        raise RLHFError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RLHFError("--device cuda: torch sees no CUDA device here; use --device cpu")
    floor = DEFAULT_FLOOR[device] if floor is None else floor
    if factor < 0 or floor < 0:
        raise RLHFError(f"--factor ({factor}) and --floor ({floor}) must be >= 0")
    if compile not in COMPILE_CHOICES:
        raise RLHFError(f"--compile must be one of {', '.join(COMPILE_CHOICES)}, got {compile!r}")
    parallel, nproc, args = _check_inputs(folder, tp=tp, pp=pp, vpp=vpp,
                                          sequence_parallel=sequence_parallel, nproc=nproc,
                                          num_seqs=num_seqs, max_len=max_len, device=device,
                                          ep=ep, cp=cp, cp_attention=cp_attention)
    if reference != folder:
        _check_inputs(reference, tp=1, pp=1, vpp=1, sequence_parallel=False, nproc=1,
                      num_seqs=num_seqs, max_len=max_len, device="cpu")
    seqs = random_batch(args, _pad_id(reference), num_seqs=num_seqs, max_len=max_len, seed=seed)
    aux_weight = MOE_AUX_WEIGHT if args.is_moe and pp == 1 else 0.0
    ref = hf_reference(reference, seqs, device=device, dtype=torch.float64, aux_weight=aux_weight)
    theirs = distances(hf_reference(reference, seqs, device=device, dtype=torch.float32,
                                    aux_weight=aux_weight), ref)
    with tempfile.TemporaryDirectory(prefix="rlhf-verify-") as tmp:
        ref_path = Path(tmp) / "reference.pt"
        torch.save(ref, ref_path)
        scales = _scales(ref)
        del ref
        per_rank = run_distributed(_rank_check, nproc, str(folder), parallel, str(ref_path), seqs,
                                   device, aux_weight, compile, timeout_s=timeout_s,
                                   backend="nccl" if device == "cuda" else "gloo")
    ours = {check: max(r[check] for r in per_rank) for check in OUTPUTS if check in per_rank[0]}
    ours["grads"] = {n: max(r["grads"][n] for r in per_rank) for n in per_rank[0]["grads"]}
    errors = judge(ours, theirs, scales, factor=factor, floor=floor)
    return {
        "model": str(folder), "model_type": args.model_type,
        **({"reference": str(reference)} if reference != folder else {}),
        "layout": {"tp": tp, "pp": pp, "dp": nproc // (tp * cp * pp), "nproc": nproc,
                   "sequence_parallel": sequence_parallel, **({"vpp": vpp} if vpp > 1 else {}),
                   **({"ep": ep} if ep > 1 else {}),
                   **({"cp": cp, "cp_attention": cp_attention} if cp > 1 else {})},
        "num_seqs": len(seqs), "num_tokens": sum(len(s) for s in seqs), "seed": seed,
        "device": per_rank[0]["device"], "tf32": per_rank[0]["tf32"],
        "compiled": per_rank[0]["compiled"],
        "max_abs_diff": {check: e.get("max_ours", e["ours"]) for check, e in errors.items()},
        "worst_grad": errors["grads"]["worst"], "factor": factor, "floor": floor,
        "errors": errors, "passed": all(e["passed"] for e in errors.values()),
    }


def distances(got: dict, want: dict) -> dict:
    """Max abs difference per quantity, and per parameter for grads (keys of `want`)."""
    out = {check: _max_diff(check, got[check], want[check]) for check in OUTPUTS
           if check in want and check in got}
    if got["grads"].keys() != want["grads"].keys():
        raise RLHFError(f"parameter names differ from transformers': "
                        f"{sorted(got['grads'].keys() ^ want['grads'].keys())}")
    out["grads"] = {n: _max_diff(n, got["grads"][n], want["grads"][n]) for n in want["grads"]}
    return out


def _scales(ref: dict) -> dict:
    out = {check: ref[check].abs().max().item() for check in OUTPUTS if check in ref}
    out["grads"] = {n: g.abs().max().item() for n, g in ref["grads"].items()}
    return out


def judge(ours: dict, theirs: dict, scales: dict, *, factor: float, floor: float) -> dict:
    """Per quantity: our and transformers' fp32 max abs error against float64, both also
    relative to the reference's largest magnitude, the limit, and whether ours is within it.
    Grads are judged parameter by parameter: the row is the worst one's (error / limit), with
    the max over all parameters beside it."""
    out = {}
    for check in OUTPUTS:
        if check in ours:
            out[check] = _row(ours[check], theirs[check], scales[check], factor=factor,
                              floor=floor)
    rows = {n: _row(ours["grads"][n], theirs["grads"][n], scales["grads"][n], factor=factor,
                    floor=floor) for n in ours["grads"]}
    worst = max(rows, key=lambda n: rows[n]["ours"] / max(rows[n]["limit"], 1e-300))
    out["grads"] = {**rows[worst], "worst": worst,
                    "max_ours": max(r["ours"] for r in rows.values()),
                    "max_transformers_fp32": max(r["transformers_fp32"] for r in rows.values()),
                    "passed": all(r["passed"] for r in rows.values())}
    return out


def _row(ours: float, theirs: float, scale: float, *, factor: float, floor: float) -> dict:
    limit = factor * theirs + floor
    rel = (lambda x: x / scale if scale > 0 else 0.0)
    return {"ours": ours, "transformers_fp32": theirs, "limit": limit, "scale": scale,
            "ours_rel": rel(ours), "transformers_fp32_rel": rel(theirs), "passed": ours <= limit}


def _check_inputs(folder: Path, *, tp, pp, vpp, sequence_parallel, nproc, num_seqs, max_len,
                  device="cpu", ep=1, cp=1, cp_attention: CpAttention = "all_gather"):
    parallel = ParallelConfig(tp=tp, pp=pp, vpp=vpp, sequence_parallel=sequence_parallel, ep=ep,
                              cp=cp, cp_attention=cp_attention)
    if not folder.is_dir():
        raise RLHFError(f"{folder} is not a folder; pass a Hugging Face model folder")
    args = ModelArgs.from_pretrained(folder)
    check_tp_compatible(args, tp)
    split_layers(args.num_layers, stages=pp * vpp)  # ConfigError when there are too few layers
    gpus = torch.cuda.device_count() if device == "cuda" else None
    ranks = parallel.model_ranks * ep
    if nproc is None:
        nproc = gpus if gpus is not None else ranks
    if nproc < 1 or nproc % ranks:
        where = f" (the {gpus} visible GPUs)" if gpus is not None else ""
        product = "tp * " + ("cp * " if cp > 1 else "") + "pp" + (" * ep" if ep > 1 else "")
        raise RLHFError(f"--nproc {nproc}{where} is not a positive multiple of {product} = "
                        f"{ranks}; pass --nproc")
    if ep > 1 and (not args.num_experts or args.num_experts % ep):
        raise RLHFError(f"--ep {ep} needs a mixture-of-experts model whose expert count it "
                        f"divides; {folder} has {args.num_experts} experts")
    if gpus is not None and nproc > gpus:
        raise RLHFError(f"--nproc {nproc} needs a GPU per process but {gpus} are visible")
    if num_seqs < 1 or max_len < 1:
        raise RLHFError(f"num_seqs ({num_seqs}) and max_len ({max_len}) must be positive")
    return parallel, nproc, args


def _pad_id(folder: Path) -> int | None:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return config.get("pad_token_id")


def random_batch(args: ModelArgs, pad_id: int | None, *, num_seqs: int, max_len: int,
                 seed: int) -> list[torch.Tensor]:
    """Seeded sequences of random lengths in [1, max_len] and random tokens.

    The pad id is left out: transformers' embedding (padding_idx=pad_id) gives that row no
    gradient from lookups, while a packed model has no padding and treats it as any token.
    """
    gen = torch.Generator().manual_seed(seed)
    longest = min(max_len, args.max_position_embeddings)
    lengths = torch.randint(1, longest + 1, (num_seqs,), generator=gen).tolist()
    skip = pad_id is not None and 0 <= pad_id < args.vocab_size
    seqs = [torch.randint(0, args.vocab_size - skip, (n,), generator=gen) for n in lengths]
    return [s + (s >= pad_id).long() if skip else s for s in seqs]


def verification_loss(log_probs_T, entropy_T, valid_T):
    """Mean next-token log-prob over valid positions plus mean entropy (an MoE model's check
    adds MOE_AUX_WEIGHT x the load-balancing loss)."""
    return (log_probs_T * valid_T).sum() / valid_T.sum().clamp(min=1) + entropy_T.mean()


@contextlib.contextmanager
def ieee_fp32():
    """fp32 matmuls in full fp32 inside (no TF32 on CUDA), the previous setting restored after."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def hf_reference(folder: Path, seqs: list[torch.Tensor], *, device: str = "cpu",
                 dtype: torch.dtype = torch.float64, aux_weight: float = 0.0) -> dict:
    """transformers in `dtype` on `device` (its first GPU for "cuda"), sequence by sequence:
    logits, log-probs, entropy, grads (under our per-expert names); on the CPU. `aux_weight`
    > 0 (an MoE model): the loss adds that times the load-balancing loss of all the tokens,
    returned as "aux_loss"."""
    from transformers import AutoModelForCausalLM

    from rlhf.models.gguf import quiet_transformers

    # transformers' default grouped-matmul experts take no float64: its plain loop is the
    # reference (the experts' own sums are the same).
    moe = {"experts_implementation": "eager"} if ModelArgs.from_pretrained(folder).is_moe else {}
    with quiet_transformers():  # a loading bar would garble the tool's output
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **moe).to(device).eval()
    extra = {"output_router_logits": True} if aux_weight else {}
    with ieee_fp32():
        outs = [hf(s[None].to(device), **extra) for s in seqs]
        logits_TV = torch.cat([o.logits[0] for o in outs])
        targets_T, valid_T = (t.to(device) for t in shifted_targets(pack(seqs)))
        logp_TV = torch.log_softmax(logits_TV, -1)
        log_probs_T = logp_TV.gather(-1, targets_T[:, None])[:, 0] * valid_T
        entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
        loss = verification_loss(log_probs_T, entropy_T, valid_T)
        aux = {}
        if aux_weight:
            aux["aux_loss"] = _hf_aux_loss(hf, outs)
            loss = loss + aux_weight * aux["aux_loss"]
        loss.backward()
    return {"logits": logits_TV.detach().cpu(), "log_probs": log_probs_T.detach().cpu(),
            "entropy": entropy_T.detach().cpu(), "valid": valid_T.cpu(),
            **{k: v.detach().cpu() for k, v in aux.items()},
            "grads": split_fused_experts({n: p.grad.cpu() for n, p in hf.named_parameters()})}


def _hf_aux_loss(hf, outs) -> torch.Tensor:
    """transformers' load-balancing loss over every sequence's tokens (packed, no padding)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    router = tuple(torch.cat(layer) for layer in zip(*[o.router_logits for o in outs]))
    return load_balancing_loss_func(router, hf.config.num_experts, hf.config.num_experts_per_tok)


def _rank_check(rank: int, world: int, folder: str, parallel: ParallelConfig, ref_path: str,
                seqs: list[torch.Tensor], device_type: str = "cpu",
                aux_weight: float = 0.0, compile: Compile = "auto") -> dict:
    # run_distributed made this rank's GPU the current device (NCCL).
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device("cpu")
    with ieee_fp32():
        report = _compare(folder, parallel, torch.load(ref_path, mmap=True), seqs, world=world,
                          device=device, aux_weight=aux_weight, compile=compile)
        tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return {**report, "device": _device_name(device), "tf32": tf32,
            "compiled": compile_enabled(compile, device)}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _compare(folder: str, parallel: ParallelConfig, ref: dict, seqs: list[torch.Tensor], *,
             world: int, device: torch.device, aux_weight: float = 0.0,
             compile: Compile = "auto") -> dict:
    ref["valid"] = ref["valid"].to(device)
    mesh = ParallelMesh(list(range(world)), tp=parallel.tp, pp=parallel.pp, ep=parallel.ep,
                        cp=parallel.cp, cache=ProcessGroupCache())
    built = build_model(folder, mesh=mesh, parallel=parallel, head="lm", device=device)
    model = built.model
    # A training engine, for its grad buffer and sync; its optimizer never steps.
    engine = TrainEngine(built, mesh, optim=OptimizerConfig(), router_aux_loss_coef=aux_weight,
                         compile=compile)
    if parallel.pp > 1 or (parallel.cp > 1 and not model.args.is_moe):
        return _schedule_check(engine, seqs, ref)
    if parallel.cp > 1:  # the aux loss pools one pack: the whole batch, on cp shards
        return _moe_check(engine, seqs, ref)
    packed = _to_device(pack(seqs), device)
    with torch.no_grad():
        shard = vocab_shard(model, mesh)
        logits_TV = all_gather(forward_packed(model, packed, mesh=mesh, tp=built.tp), dim=-1,
                               group=shard["group"])[:, : shard["real_vocab_size"]]
    if model.args.is_moe:
        return {**_moe_check(engine, seqs, ref),
                "logits": _max_diff("logits", logits_TV, ref["logits"])}
    out = model_outputs(model, packed, mesh=mesh, tp=built.tp)
    # Every DP replica runs the whole batch; the DP sum of 1/dp of the loss is the loss.
    loss = verification_loss(out["log_probs"], out["entropy"], ref["valid"]) / mesh.dp_size
    loss.backward()
    engine.sync_grads()
    got = {"logits": logits_TV, "log_probs": out["log_probs"], "entropy": out["entropy"],
           "grads": engine.full_grads()}
    return distances(got, ref)


def _schedule_check(engine: TrainEngine, seqs: list[torch.Tensor], ref: dict) -> dict:
    """The engine schedule's backward and forward-only pass over micro-batches of two (the
    pipeline's, each cp rank on its shard of the tokens)."""
    mbs = [MicroBatch(pack_prompt_response([s[:1] for s in part], [s[1:] for s in part]))
           .to(engine.device) for part in (seqs[i:i + 2] for i in range(0, len(seqs), 2))]
    num_valid, num_tokens = ref["valid"].sum().clamp(min=1), ref["valid"].numel()
    dp = engine.mesh.dp_size

    def loss_fn(out, mb):  # each micro-batch's share of verification_loss, 1/dp of it
        _, valid_T = shifted_targets(mb.packed)
        valid_T = valid_T.to(out["log_probs"].device)
        return ((out["log_probs"] * valid_T).sum() / num_valid
                + out["entropy"].sum() / num_tokens) / dp, {}

    engine.forward_backward(mbs, loss_fn, outputs=LM_OUTPUTS)
    outs = engine.forward(mbs, outputs=LM_OUTPUTS)
    grads = engine.full_grads()
    if not outs:  # outputs exist on the last stage only
        return {"log_probs": 0.0, "entropy": 0.0, **distances({"grads": grads}, ref)}
    got = {key: torch.cat([o[key] for o in outs]) for key in ("log_probs", "entropy")}
    return distances({**got, "grads": grads}, {k: v for k, v in ref.items() if k != "logits"})


def _moe_check(engine: TrainEngine, seqs: list[torch.Tensor], ref: dict) -> dict:
    """The engine's training step over one micro-batch of the whole batch: it adds the router
    aux loss (weighted as the reference) and reports it."""
    mb = MicroBatch(pack_prompt_response([s[:1] for s in seqs], [s[1:] for s in seqs]))
    mb = mb.to(engine.device)
    dp = engine.mesh.dp_size

    def loss_fn(out, mb):  # 1/dp of verification_loss: each DP replica runs the whole batch
        return verification_loss(out["log_probs"], out["entropy"], ref["valid"]) / dp, {}

    metrics = engine.forward_backward([mb], loss_fn, outputs=LM_OUTPUTS)
    out = engine.forward([mb], outputs=LM_OUTPUTS)[0]
    got = {"log_probs": out["log_probs"], "entropy": out["entropy"],
           "aux_loss": torch.tensor(metrics["router_aux_loss"]), "grads": engine.full_grads()}
    return distances(got, {k: v for k, v in ref.items() if k != "logits"})


def _max_diff(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        raise RLHFError(f"{name}: shape {tuple(got.shape)} but transformers gives "
                        f"{tuple(want.shape)}")
    if not want.numel():
        return 0.0
    # One float64 buffer, not three: these are whole models' grads, on every rank
    diff = got.detach().to("cpu", torch.float64, copy=True)
    return diff.sub_(want.to("cpu", torch.float64)).abs_().max().item()


def _to_device(packed, device: torch.device):
    if device.type == "cpu":
        return packed
    return dataclasses.replace(packed, **{f.name: getattr(packed, f.name).to(device)
                                          for f in dataclasses.fields(packed)
                                          if isinstance(getattr(packed, f.name), torch.Tensor)})
