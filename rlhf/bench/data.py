"""Start-up time and resident memory of the indexed (memory-mapped) and in-memory prompt readers.

For each row count, synthetic prompts are written twice under --dir: as an indexed dataset
folder (written directly with numpy, as `rlhf preprocess-data` lays it out) and, up to
--in-memory-max-rows, as a JSONL file. A fresh child process per (reader, rows) measures the
seconds and resident memory (anonymous and file-backed, above the process's after its imports)
to open the dataset and to draw the first shuffled batch. Then, for each of --order-rows, a
child builds an epoch's order the way the loader did before rlhf.data.shuffle (numpy's stored
permutation, 8 bytes a row) and another computes the first batch's positions of the loader's
order; nothing is written for those. Everything written is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MIB = 1024**2
TOKENS_PER_ROW = (8, 24)  # synthetic prompt lengths, uniform in [low, high)
WRITE_CHUNK = 1_000_000
ORDERS = ("stored-order", "computed-order")  # --measure kinds that need no data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000, 10_000_000])
    parser.add_argument("--in-memory-max-rows", type=int, default=1_000_000,
                        help="the in-memory reader only up to this many rows (it holds a Python "
                             "object per row: about 1 KB each)")
    parser.add_argument("--order-rows", type=int, nargs="*", default=[10_000_000, 100_000_000],
                        help="row counts at which to measure the epoch order alone (no data)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dir", default="/tmp", help="where the synthetic data is written")
    parser.add_argument("--measure", nargs=2, default=None, help=argparse.SUPPRESS)  # a child


def _rss_mib() -> tuple[float, float]:
    """(anonymous, file-backed) resident memory: mapped file pages are page cache the kernel
    drops under pressure; anonymous pages are the reader's own."""
    fields = dict(line.split(":", 1) for line in
                  Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return (int(fields["RssAnon"].split()[0]) / 1024, int(fields["RssFile"].split()[0]) / 1024)


def _line(i: int) -> str:
    return json.dumps({"raw_prompt": f"{i}+1=", "ground_truth": str(i + 1),
                       "extra": {"data_source": "synthetic"}, "location": f"synthetic:{i}"})


def write_indexed(folder: Path, rows: int, *, seed: int = 0) -> None:
    """A prompts dataset of `rows` random rows, laid out as rlhf.data.indexed describes."""
    from rlhf.data import indexed  # noqa: PLC0415 - torch; not for --help

    folder.mkdir()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(*TOKENS_PER_ROW, size=rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(folder / indexed.OFFSETS, offsets)
    with open(folder / indexed.TOKENS, "wb") as f:
        for start in range(0, int(offsets[-1]), WRITE_CHUNK * 16):
            count = min(WRITE_CHUNK * 16, int(offsets[-1]) - start)
            f.write(rng.integers(0, 2**15, size=count, dtype=np.uint16).tobytes())
    line_lengths = np.empty(rows, dtype=np.int64)
    with open(folder / indexed.ROWS, "wb") as f:
        for start in range(0, rows, WRITE_CHUNK):
            lines = [_line(i) + "\n" for i in range(start, min(start + WRITE_CHUNK, rows))]
            line_lengths[start:start + len(lines)] = [len(line) for line in lines]
            f.write("".join(lines).encode())
    np.save(folder / indexed.ROW_OFFSETS, np.concatenate([[0], np.cumsum(line_lengths)]))
    (folder / indexed.MANIFEST).write_text(json.dumps({
        "format": indexed.FORMAT, "kind": indexed.PROMPTS, "rows": rows, "tokens": int(offsets[-1]),
        "max_prompt_length": int(lengths.max()), "dtype": "uint16", "tokenizer": {}}))


def write_jsonl(path: Path, rows: int) -> None:
    with open(path, "w") as f:
        for start in range(0, rows, WRITE_CHUNK):
            f.write("".join(json.dumps({"prompt": f"{i}+1=", "ground_truth": str(i + 1)}) + "\n"
                            for i in range(start, min(start + WRITE_CHUNK, rows))))


def _child(reader: str, path: str, batch_size: int, tokenizer_dir: str) -> dict:
    """Open the dataset and draw one shuffled batch, timing both (this process only)."""
    from rlhf.data.dataset import PromptDataset, PromptLoader  # noqa: PLC0415
    from rlhf.data.indexed import IndexedPromptDataset  # noqa: PLC0415

    tokenizer = None
    if reader == "in-memory":
        from transformers import AutoTokenizer  # noqa: PLC0415

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    base = _rss_mib()
    start = time.perf_counter()
    dataset = (IndexedPromptDataset(path, None, max_prompt_length=64) if reader == "indexed"
               else PromptDataset.from_files([path], tokenizer, max_prompt_length=64))
    opened = time.perf_counter()
    rss_open = _rss_mib()
    batch = next(PromptLoader(dataset, batch_size=batch_size, seed=0))
    drawn = time.perf_counter()
    assert len(batch) == batch_size
    rss_batch = _rss_mib()
    return {"reader": reader, "rows": len(dataset), "startup_s": round(opened - start, 4),
            "startup_anon_mib": round(rss_open[0] - base[0], 1),
            "startup_file_mib": round(rss_open[1] - base[1], 1),
            "first_batch_s": round(drawn - opened, 4),
            "first_batch_anon_mib": round(rss_batch[0] - base[0], 1),
            "first_batch_file_mib": round(rss_batch[1] - base[1], 1)}


def _order_child(kind: str, rows: int, batch_size: int) -> dict:
    """The seconds and anonymous memory of one epoch's order: numpy's stored permutation
    (the loader's before rlhf.data.shuffle) or the first batch of the computed one."""
    from rlhf.data.shuffle import Permutation  # noqa: PLC0415

    base = _rss_mib()[0]
    start = time.perf_counter()
    if kind == "stored-order":
        order = np.random.default_rng([0, 0]).permutation(rows).astype(np.int64)
    else:
        order = Permutation(rows, seed=0, epoch=0).take(0, batch_size)
    seconds = time.perf_counter() - start
    return {"reader": kind, "rows": rows, "held": len(order), "seconds": round(seconds, 4),
            "anon_mib": round(_rss_mib()[0] - base, 1)}


def _measure(reader: str, path: Path | int, args, tokenizer_dir: Path) -> dict:
    command = [sys.executable, "-m", "rlhf.cli", "bench", "data", "--measure", reader, str(path),
               "--batch-size", str(args.batch_size), "--dir", str(tokenizer_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"reader": reader, "path": str(path), "error": done.stderr[-2000:]}
    return json.loads(lines[-1])


def run(args: argparse.Namespace) -> int:
    if args.measure is not None:
        reader, path = args.measure
        result = (_order_child(reader, int(path), args.batch_size) if reader in ORDERS
                  else _child(reader, path, args.batch_size, args.dir))
        print(json.dumps(result), flush=True)
        return 0
    from rlhf.demo.tiny_tokenizer import train_tiny_tokenizer  # noqa: PLC0415

    root = Path(tempfile.mkdtemp(prefix="rlhf-bench-data-", dir=args.dir))
    try:
        tokenizer_dir = root / "tokenizer"
        train_tiny_tokenizer(vocab_size=384, seed=0).save_pretrained(tokenizer_dir)
        for rows in args.rows:
            start = time.perf_counter()
            write_indexed(root / f"indexed-{rows}", rows)
            disk = sum(f.stat().st_size for f in (root / f"indexed-{rows}").iterdir())
            print(json.dumps({"kind": "written", "rows": rows, "indexed_mib": round(disk / MIB),
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)
            print(json.dumps({"kind": "measured", **_measure(
                "indexed", root / f"indexed-{rows}", args, tokenizer_dir)}), flush=True)
            shutil.rmtree(root / f"indexed-{rows}")
            if rows <= args.in_memory_max_rows:
                write_jsonl(root / f"rows-{rows}.jsonl", rows)
                print(json.dumps({"kind": "measured", **_measure(
                    "in-memory", root / f"rows-{rows}.jsonl", args, tokenizer_dir)}), flush=True)
                (root / f"rows-{rows}.jsonl").unlink()
            else:
                print(json.dumps({"kind": "skipped", "reader": "in-memory", "rows": rows,
                                  "reason": f"above --in-memory-max-rows="
                                            f"{args.in_memory_max_rows}"}), flush=True)
        for rows in args.order_rows:
            for kind in ORDERS:
                print(json.dumps({"kind": "measured", **_measure(kind, rows, args,
                                                                 tokenizer_dir)}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0
