"""Before/after timings of the training engine on one machine, the two code trees taking turns.

    git archive <before-commit> | tar -x -C /tmp/before
    python examples/engine_speed_ab.py --before /tmp/before --after . --repeats 5 engine -- \
        --size tiny --layers 4 --hidden 512 --intermediate 1408 --vocab 8192 --tokens 1024 \
        --seq-len 256 --steps 3 --no-logprobs --no-offload
    python examples/engine_speed_ab.py --before /tmp/before --after . --repeats 5 moe-layer
    python examples/engine_speed_ab.py --before /tmp/before --after . --repeats 3 dense-mlp
    python examples/engine_speed_ab.py --before /tmp/before --after . --repeats 2 step -- \
        --model quickstart --steps 3

Each repeat runs the "before" tree, then the "after" one (each a fresh interpreter with that
tree first on PYTHONPATH), so a change in the machine's load slows both alike; the medians over
the repeats are printed as one JSON line per tree and a line with the after/before ratios.
`engine`: `rlhf bench engine` with the arguments after `--` (its "step" line: step_s,
tokens_per_s, mfu, forward_backward_s, optimizer_step_s). `step`: `rlhf bench step` with the
arguments after `--` (our trainer's line, its per-phase seconds as s_<phase>, and the ratio to
transformers from the same run). `moe-layer`: forward and backward of one Qwen3-MoE block
(the router and the experts) on a random token stream, in bf16 on CUDA when present, else fp32
on the CPU. `dense-mlp`: forward and backward of one dense MLP as the tree runs it and with
the two linears of gate and up, the two taking turns in one process (their ratio is the
one-GEMM gain on a loaded machine too), same dtypes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MOE_SHAPE = dict(hidden=512, experts=16, top_k=2, intermediate=256, tokens=2048)
MLP_SHAPE = dict(hidden=1024, intermediate=2816, tokens=1024)


def _dense_mlp(repeats: int = 5) -> dict:
    """Median seconds of one dense MLP's forward + backward as the tree's engine runs it
    (`dense_mlp_s`: gate and up paired for one GEMM where the tree has
    `rlhf.models.transformer.pair_gate_up`) and with the two linears (`two_linears_s`), the
    two taking turns in this process."""
    import torch

    from rlhf.models.config import ModelArgs
    from rlhf.models.transformer import MLP

    s = MLP_SHAPE
    args = ModelArgs.from_hf_config(dict(
        model_type="llama", vocab_size=64, hidden_size=s["hidden"],
        intermediate_size=s["intermediate"], num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=8))
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    two = MLP(args).to(device, dtype)
    ours = MLP(args).to(device, dtype)
    ours.load_state_dict(two.state_dict())
    try:
        from rlhf.models.transformer import pair_gate_up
    except ImportError:  # a tree from before the pairing
        pair_gate_up = None
    if pair_gate_up is not None:
        pair_gate_up(ours)
    x = torch.randn(s["tokens"], s["hidden"], device=device, dtype=dtype, requires_grad=True)
    walls: dict[str, list[float]] = {"dense_mlp_s": [], "two_linears_s": []}
    for i in range(repeats + 1):
        for key, mlp in (("dense_mlp_s", ours), ("two_linears_s", two)):
            start = time.perf_counter()
            mlp(x).float().square().mean().backward()
            if cuda:
                torch.cuda.synchronize()
            if i:  # the first warms the allocator
                walls[key].append(time.perf_counter() - start)
    return {**{k: round(statistics.median(v), 5) for k, v in walls.items()},
            "paired": pair_gate_up is not None, "device": device, **s}


def _moe_layer(repeats: int = 3) -> dict:
    """Median seconds of one MoE block's forward + backward (run inside a tree's interpreter)."""
    import torch

    from rlhf.models.config import ModelArgs
    from rlhf.models.moe import SparseMoeBlock

    s = MOE_SHAPE
    args = ModelArgs.from_hf_config(dict(
        model_type="qwen3_moe", vocab_size=64, hidden_size=s["hidden"], intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
        num_experts=s["experts"], num_experts_per_tok=s["top_k"],
        moe_intermediate_size=s["intermediate"]))
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    block = SparseMoeBlock(args, layer=0).to(device, dtype)
    x = torch.randn(s["tokens"], s["hidden"], device=device, dtype=dtype, requires_grad=True)
    walls = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        block(x).float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        if i:  # the first warms the allocator
            walls.append(time.perf_counter() - start)
    return {"moe_layer_s": round(statistics.median(walls), 5), "device": device, **s}


def _run(tree: Path, mode: str, rest: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    if mode in ("engine", "step"):
        cmd = [sys.executable, "-m", "rlhf.cli", "bench", mode, *rest]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--inner", mode]
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if mode == "step":
        ours = next(r for r in records if r.get("system") == "ours")
        ratio = next(r for r in records if "summary" in r)["ours_over_transformers"]
        return {**{k: v for k, v in ours.items() if isinstance(v, float)},
                **{f"s_{k}": v for k, v in ours["seconds"].items()},
                "ours_over_transformers": float(ratio)}
    for record in records:
        if mode != "engine" or record.get("kind") == "step":
            return record
    raise RuntimeError(f"no result line from {cmd}: {out.stdout[-2000:]} {out.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("mode", nargs="?", choices=("engine", "step", "moe-layer", "dense-mlp"))
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.inner:
        print(json.dumps(_dense_mlp() if args.inner == "dense-mlp" else _moe_layer()))
        return
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(_run(getattr(args, name), args.mode, rest))
            print(json.dumps({"run": name, **runs[name][-1]}), file=sys.stderr, flush=True)
    keys = [k for k, v in runs["after"][0].items() if isinstance(v, float)]
    medians = {name: {k: statistics.median(r[k] for r in got) for k in keys}
               for name, got in runs.items()}
    for name, values in medians.items():
        print(json.dumps({"tree": name, "repeats": args.repeats, **values}))
    print(json.dumps({"after_over_before": {k: round(medians["after"][k] / medians["before"][k], 3)
                                            for k in keys if medians["before"][k]}}))


if __name__ == "__main__":
    main()
