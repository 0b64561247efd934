"""Learning parity of the asynchronous modes (issue 42): the quickstart task ("max of two
numbers", configs/quickstart.yaml) trained by PPO synchronously and with trainer.async_mode
streaming (and one_step), from one shared SFT warm start, same seed, steps, batch, model and
data. Every arm runs on the same 2 ranks: 1 trainer rank (actor, critic, ref) and 1 rollout rank
of its own (rollout.placement separate), so the only difference between arms is async_mode.
Prints one JSON line: each arm's val/accuracy before and after, final train reward, steps,
wall time and token staleness, and each async arm's accuracy gap to sync against --tolerance.

    PYTHONPATH=$PWD python examples/async_parity.py [--steps 100] [--arms off streaming one_step]

The quickstart's responses are a few tokens (max_new_tokens 8), under the default 64-token
stream segment, so plain streaming finishes every sample in its first segment; an arm
streaming:2 (2-token segments) continues samples in flight under new weights.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from rlhf.trainer.loggers import read_metrics

CONFIG = "configs/quickstart.yaml"
SAME_RANKS = ["trainer.ranks_per_node=1", "rollout.placement=separate", "rollout.world_size=1"]


def rlhf(*args: str, log: Path | None = None) -> None:
    """One `rlhf` CLI command in this interpreter; its output goes to `log` when given."""
    cmd = [sys.executable, "-m", "rlhf.cli", *args]
    if log is None:
        subprocess.run(cmd, check=True)
        return
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:2])} failed (exit {done.returncode}); see {log}")


def prepare(out: Path) -> list[str]:
    """The tiny model, the data and the SFT warm start under `out` (each built once, reused by
    every arm and every later run); returns the overrides pointing the config at them."""
    data = out / "data"
    if not (out / "model" / "config.json").exists():
        rlhf("make-tiny-model", str(out / "model"))
    for name, kind, split, n in [("train", "rl", "train", 2000), ("val", "rl", "val", 200),
                                 ("sft_train", "format", "train", 2000)]:
        if not (data / f"{name}.jsonl").exists():
            rlhf("make-dataset", "arith", str(data / f"{name}.jsonl"), "--form", "max",
                 "--max-value", "99", "--kind", kind, "--split", split, "--n", str(n),
                 "--seed", "0")
    paths = [f"sft.init_path={out / 'model'}", f"sft.output_path={out / 'sft_model'}",
             f"sft.train_files=[{data / 'sft_train.jsonl'}]",
             f"data.train_files=[{data / 'train.jsonl'}]",
             f"data.val_files=[{data / 'val.jsonl'}]", f"model.path={out / 'sft_model'}"]
    if not (out / "sft_model" / "config.json").exists():
        rlhf("sft", CONFIG, *paths, log=out / "sft.log")
    return paths


def staleness(record: dict) -> tuple[float, float]:
    """(mean, max) versions-old of a step's trained data: streaming reports it per token
    (async/token_staleness_<s> shares), one_step and bounded per sample (async/staleness_*)."""
    if "async/staleness_mean" in record:
        return record["async/staleness_mean"], record["async/staleness_max"]
    shares = {int(m.group(1)): v for k, v in record.items()
              if (m := re.fullmatch(r"async/token_staleness_(\d+)", k))}
    return sum(s * share for s, share in shares.items()), record["async/token_staleness_p100"]


def run_arm(arm_name: str, steps: int, out: Path, paths: list[str]) -> dict:
    """One PPO run; `arm_name` is an async_mode, or streaming:N for N-token segments."""
    mode, _, segment = arm_name.partition(":")
    run_dir = out / f"run_{arm_name.replace(':', '_seg')}"
    args = [*paths, *SAME_RANKS, f"trainer.output_dir={run_dir}", f"trainer.total_steps={steps}",
            f"trainer.val_every={max(steps // 4, 1)}", f"trainer.save_every={steps}",
            f"trainer.async_mode={mode}", f"trainer.experiment_name={run_dir.name}"]
    if segment:
        args.append(f"trainer.stream_segment_tokens={segment}")
    t0 = time.perf_counter()
    rlhf("train", CONFIG, *args, log=out / f"train_{run_dir.name}.log")
    wall = time.perf_counter() - t0
    records = read_metrics(run_dir)
    vals = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    trained = [r for r in records if "reward/mean" in r]
    last = trained[-10:]
    arm = {"val_accuracy_before": vals[0][1], "val_accuracy_after": vals[-1][1],
           "val_accuracy_by_step": dict(vals), "final_reward": trained[-1]["reward/mean"],
           "reward_last10_mean": sum(r["reward/mean"] for r in last) / len(last),
           "steps": len(trained), "wall_s": round(wall, 1)}
    if mode != "off":
        stale = [staleness(r) for r in trained]
        arm["staleness_mean"] = sum(mean for mean, _ in stale) / len(stale)
        arm["staleness_max"] = max(most for _, most in stale)
        for key in ("interrupted_samples", "regenerated_samples", "dropped_samples"):
            arm[key] = sum(r.get(f"async/{key}", 0.0) for r in trained)
    return arm


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Learning parity of trainer.async_mode against sync on the quickstart task.")
    parser.add_argument("--steps", type=int, default=100, help="PPO steps per arm")
    parser.add_argument("--arms", nargs="+", default=["off", "streaming", "one_step"],
                        help="async_mode values (off is sync), or streaming:N for streaming "
                        "with N-token segments, so samples continue under new weights")
    parser.add_argument("--out", type=Path, default=Path("outputs/parity"))
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="largest allowed drop of final val/accuracy below sync (absolute)")
    a = parser.parse_args()
    for arm in a.arms:
        mode, _, segment = arm.partition(":")
        if mode not in ("off", "one_step", "bounded", "streaming") or (
                segment and (mode != "streaming" or not segment.isdigit())):
            parser.error(f"arm {arm!r}: use off, one_step, bounded, streaming or streaming:N")
    paths = prepare(a.out)
    arms = {}
    for mode in a.arms:
        arms[mode] = run_arm(mode, a.steps, a.out, paths)
        print(f"# {mode}: {json.dumps(arms[mode])}", file=sys.stderr, flush=True)
    result: dict = {"arms": arms, "tolerance": a.tolerance}
    if "off" in arms:
        sync = arms["off"]["val_accuracy_after"]
        result["diff_vs_sync"] = {m: round(v["val_accuracy_after"] - sync, 4)
                                  for m, v in arms.items() if m != "off"}
        result["within_tolerance"] = {m: d >= -a.tolerance
                                      for m, d in result["diff_vs_sync"].items()}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
