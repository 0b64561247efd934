"""Per-rank activation memory and step time of one long sequence under context parallelism.

    PYTHONPATH=. python examples/cp_activation_memory.py [--tokens 4096] [--cp 1 2 4]

Builds a small Llama (fp32, CPU, gloo), shards one sequence of `--tokens` tokens over cp ranks
(rlhf.parallel.context_parallel) and reports, per cp, the bytes each rank saves for backward
during the forward (the activations a rank must hold; counted by a saved-tensors hook, one
count per storage) and the forward + backward time, beside the memory planner's prediction
for the same shapes (`rlhf.plan.memory.stage_memory`: activations plus the LM head's
workspace, an estimate made for flash attention on CUDA). The whole world is cp (dp = 1).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from rlhf.config.schema import OffloadConfig, ParallelConfig, TinyModelConfig
from rlhf.data.packing import pack, shifted_targets
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.models.build import build_model
from rlhf.models.config import ModelArgs
from rlhf.models.varlen_layout import context_layout
from rlhf.parallel.context_parallel import plan_context_shard, shard_tokens
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.parallel.vocab_parallel import vocab_parallel_log_probs_entropy
from rlhf.plan.inputs import RoleSpec
from rlhf.plan.memory import stage_memory


def _saved_bytes():
    """A saved-tensors hook pair and the dict it fills: storage -> bytes."""
    seen: dict[int, int] = {}

    def pack_hook(x):
        storage = x.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return x

    return (pack_hook, lambda x: x), seen


def _rank(rank, world, folder, tokens, repeats):
    mesh = ParallelMesh(list(range(world)), cp=world, cache=ProcessGroupCache())
    model = build_model(folder, mesh=mesh, parallel=ParallelConfig(), head="lm").model
    seq = torch.randint(1, 383, (tokens,), generator=torch.Generator().manual_seed(0))
    packed = pack([seq])
    shard = plan_context_shard([tokens], cp=world, rank=rank)
    layout = context_layout(shard, group=mesh.cp_group, device="cpu")
    targets_T, _ = shifted_targets(packed)
    local_tokens, local_targets = shard_tokens(packed.tokens, shard), shard_tokens(targets_T, shard)
    bounds = torch.tensor(shard.query_bounds, dtype=torch.int32)
    times, saved = [], 0
    for _ in range(repeats):
        hooks, seen = _saved_bytes()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            logits = model(local_tokens, shard.positions, bounds, shard.max_query, layout=layout)
            log_probs, _ = vocab_parallel_log_probs_entropy(
                logits, local_targets, group=None, vocab_start=0, vocab_end=logits.shape[-1],
                real_vocab_size=logits.shape[-1], temperature=1.0)
        log_probs.sum().backward()
        times.append(time.perf_counter() - start)
        saved = sum(seen.values())
        model.zero_grad(set_to_none=True)
    return dict(saved_mib=saved / 2**20, step_s=min(times), local_tokens=shard.num_local)


def planned_mib(folder: str, tokens: int, cp: int) -> float:
    """The memory planner's saved-for-backward bytes of one rank (activations and the head's
    workspace) for this model, one micro-batch of `tokens` tokens at `cp`, in MiB."""
    spec = RoleSpec(name="actor", head="lm", args=ModelArgs.from_pretrained(folder),
                    parallel=ParallelConfig(cp=cp), world_size=cp, colocated=True,
                    dtype=torch.float32, trains=True, recompute="none", tokens=tokens, shards=1,
                    offload=OffloadConfig())
    (stage,) = stage_memory(spec)
    return (stage.activations + stage.logits) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        spec = TinyModelConfig(arch="llama", num_layers=4, hidden_size=256, num_heads=8,
                               num_kv_heads=2, intermediate_size=688, vocab_size=384,
                               max_position_embeddings=args.tokens + 64, seed=0)
        folder = str(make_tiny_model(spec, f"{root}/model"))
        print(f"one sequence of {args.tokens} tokens; {spec.num_layers} layers, hidden "
              f"{spec.hidden_size}, 8 heads, 2 KV heads, fp32, CPU/gloo")
        print("cp  local tokens  saved for backward per rank (MiB)  planned (MiB)  "
              "fwd+bwd (s, max rank)")
        for cp in args.cp:
            per_rank = run_distributed(_rank, cp, folder, args.tokens, args.repeats,
                                       timeout_s=600)
            saved = max(r["saved_mib"] for r in per_rank)
            step = max(r["step_s"] for r in per_rank)
            plan = planned_mib(folder, args.tokens, cp)
            print(f"{cp:<3} {per_rank[0]['local_tokens']:<13} {saved:<34.1f} {plan:<14.1f} "
                  f"{step:.2f}")


if __name__ == "__main__":
    main()
