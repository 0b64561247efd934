"""Checkpoint save (blocked vs total, sync vs background) and resume verification (quick vs full).

One process (a one-rank gloo world, no Ray): an fp32 AdamW TrainEngine of a random Llama (the
quickstart's tiny model by default, `--hidden`/`--layers` for a larger one, or `--model`)
checkpointed through `CheckpointManager.save`, as `rlhf train` does (engine files through DCP,
the driver's state, the manifest, the atomic rename), `--repeats` times each way, the median.
JSON lines, each figure beside its baseline from the same run:

- "save" per mode: `blocked_s`, the seconds `save` held the caller (the training loop), and
  `total_s`, until step_N was published (`wait` right after `save`: nothing competes with the
  write here, so on a busy machine a background write takes longer than this); each as a
  ratio of the foreground (sync) save's.
- "manifest": the manifest of the last checkpoint written again with the sha256 of its data
  files recorded as they were written (what a save does) against hashing every byte anew.
- "verify": `verify_checkpoint` on that checkpoint, sizes and quick digests against every
  byte's sha256 (`trainer.full_checkpoint_hash`), each from a cold page cache (the files
  evicted with posix_fadvise) and again warm; `of_full`: quick / full.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rlhf.bench import print_checked
from rlhf.config import TinyModelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model folder (default: a random tiny Llama)")
    parser.add_argument("--layers", type=int, default=4, help="tiny model: layers (quickstart: 4)")
    parser.add_argument("--hidden", type=int, default=128,
                        help="tiny model: width (quickstart: 128; heads of 32)")
    parser.add_argument("--vocab", type=int, default=512, help="tiny model: vocabulary")
    parser.add_argument("--repeats", type=int, default=3, help="saves per mode (median kept)")
    parser.add_argument("--folder", help="where to write (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.layers < 1 or args.hidden < 32:
        raise SystemExit("--repeats and --layers must be at least 1, --hidden at least 32")
    from rlhf.parallel.launch import run_distributed

    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        root = Path(tmp)
        folder = args.model or _tiny_model(root, layers=args.layers, hidden=args.hidden,
                                           vocab=args.vocab)
        label = args.model or f"tiny llama {args.layers}x{args.hidden}"
        [lines] = run_distributed(_bench_rank, 1, str(folder), label, str(root), args.repeats,
                                  timeout_s=3600.0)
    return print_checked(lines)


def _tiny_model(root: Path, *, layers: int, hidden: int, vocab: int) -> str:
    from rlhf.demo.tiny_model import make_tiny_model

    heads = max(hidden // 32, 1)
    cfg = TinyModelConfig(num_layers=layers, hidden_size=hidden, num_heads=heads,
                          num_kv_heads=max(heads // 2, 1), intermediate_size=hidden * 2,
                          vocab_size=vocab, max_position_embeddings=256)
    return str(make_tiny_model(cfg, root / "model"))


class _LocalRole:
    """A one-rank worker group's view of an engine role, in this process: the worker's own
    checkpoint methods (workers.checkpoint.CheckpointMixin) with a list of one result, as a
    view returns one per rank, for `CheckpointManager.save`."""

    def __init__(self, engine):
        from rlhf.config.schema import OffloadConfig
        from rlhf.engine.offload import Offloader
        from workers.checkpoint import CheckpointMixin

        self.rank = CheckpointMixin()
        self.rank.engine = engine
        self.rank.offload = Offloader(engine.state_tensors, config=OffloadConfig())

    def save_checkpoint(self, folder: str, background: bool = False) -> list:
        return [self.rank.save_checkpoint(folder, background)]

    def checkpoint_written(self) -> list[bool]:
        return [self.rank.checkpoint_written()]

    def finish_checkpoint(self) -> list:
        return [self.rank.finish_checkpoint()]


def _bench_rank(rank: int, world: int, folder: str, label: str, root: str,
                repeats: int) -> list[dict]:
    from rlhf.config.schema import OptimizerConfig
    from rlhf.engine import TrainEngine
    from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
    from rlhf.trainer.checkpoint import CheckpointManager

    mesh = ParallelMesh([0], cache=ProcessGroupCache())
    engine = TrainEngine.from_pretrained(folder, mesh=mesh, optim=OptimizerConfig(),
                                         dtype="float32", device="cpu")
    params = sum(p.numel() for p in engine.model.parameters())
    model = {"model": label, "params_m": round(params / 1e6, 2)}
    role = _LocalRole(engine)
    saves: dict[str, dict[str, float]] = {}
    last = Path(root)
    for mode in ("sync", "background"):
        ckpt = CheckpointManager(Path(root) / mode, max_keep=1, background=mode == "background",
                                 report=lambda line: None)
        blocked, total = [], []
        for step in range(1, repeats + 1):
            began = time.perf_counter()
            last = ckpt.save(step, roles={"actor": role}, state={"step": step, "config": {}})
            blocked.append(time.perf_counter() - began)
            ckpt.wait()
            total.append(time.perf_counter() - began)
        saves[mode] = {"blocked_s": statistics.median(blocked),
                       "total_s": statistics.median(total)}
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    lines = []
    for mode, figures in saves.items():
        lines.append({"bench": "checkpoint", "what": "save", "mode": mode, **model,
                      "checkpoint_mb": float(f"{size / 1e6:.4g}"), **_rounded(figures),
                      "blocked_of_sync": _ratio(figures["blocked_s"],
                                                saves["sync"]["blocked_s"]),
                      "total_of_sync": _ratio(figures["total_s"], saves["sync"]["total_s"])})
    lines.append(_manifest_line(last, model))
    lines.append(_verify_line(last, model))
    return lines


def _manifest_line(folder: Path, model: dict) -> dict:
    """The manifest written with the data files' sha256 as recorded at write time against
    hashing them anew, on the same folder."""
    from rlhf.trainer.checkpoint import read_manifest, write_manifest

    files = read_manifest(folder)["files"]
    known = {name: {"size": d["size"], "sha256": d["sha256"]} for name, d in files.items()}
    as_written = _timed(lambda: write_manifest(folder, step=0, config={}, known=known))
    reread = _timed(lambda: write_manifest(folder, step=0, config={}))
    return {"bench": "checkpoint", "what": "manifest", **model,
            "hashed_as_written_s": as_written, "rehashed_s": reread,
            "of_rehashed": _ratio(as_written, reread)}


def _verify_line(folder: Path, model: dict) -> dict:
    from rlhf.trainer.checkpoint import verify_checkpoint

    line: dict = {"bench": "checkpoint", "what": "verify", **model}
    for cache in ("cold", "warm"):
        for check, full in (("full", True), ("quick", False)):
            if cache == "cold":
                _evict(folder)
            line[f"{check}_{cache}_s"] = _timed(
                lambda full=full: _checked(verify_checkpoint(folder, full_hash=full)))
        line[f"of_full_{cache}"] = _ratio(line[f"quick_{cache}_s"], line[f"full_{cache}_s"])
    return line


def _checked(problem: str | None) -> None:
    if problem is not None:
        raise RuntimeError(f"the benchmark's own checkpoint does not verify: {problem}")


def _evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (after syncing them)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn: Callable[[], object]) -> float:
    began = time.perf_counter()
    fn()
    return float(f"{time.perf_counter() - began:.4g}")


def _ratio(value: float, baseline: float) -> float:
    return float(f"{value / baseline:.3g}") if baseline > 0 else float("nan")


def _rounded(figures: dict[str, float]) -> dict[str, float]:
    return {k: float(f"{v:.4g}") for k, v in figures.items()}
