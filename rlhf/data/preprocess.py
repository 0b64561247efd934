"""`rlhf preprocess-data`: JSONL, Parquet or Hugging Face `datasets` folders in, one indexed
dataset (rlhf.data.indexed) out.

Rows stream from the inputs in order and are tokenised in chunks by a pool of processes, one
tokenizer each; the parent appends each chunk's tokens, loss mask and fields as it comes back,
in input order, to files in a hidden temporary folder beside the output. The folder is renamed
into place after the manifest is written, so a stopped run leaves nothing that looks complete
(only the hidden folder, which the next run of the same command does not read).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlhf.data.dataset import check_row, file_records, question_text, tokenize_prompts
from rlhf.data.indexed import (
    FORMAT,
    KINDS,
    LOSS_MASK,
    MANIFEST,
    OFFSETS,
    PROMPTS,
    ROW_OFFSETS,
    ROWS,
    SFT,
    TOKENS,
    token_dtype,
    tokenizer_fingerprint,
)
from rlhf.data.sft_rows import SFTKeys, sft_row_tokens
from rlhf.errors import RLHFError
from rlhf.files import atomic_folder

CHUNK_ROWS = 1000
"""Rows per task of the pool: large enough that pickling is a small share of the work."""


@dataclass(frozen=True)
class Job:
    """What every worker needs to tokenise a chunk."""

    kind: str
    tokenizer_path: str
    prompt_key: str = "prompt"
    ground_truth_key: str = "ground_truth"
    response_key: str = "response"
    messages_key: str = "messages"


# ---- reading the inputs ----------------------------------------------------------------------

def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa  # noqa: PLC0415 - only Parquet inputs need it
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=CHUNK_ROWS)
        row_no = 0
        for batch in batches:
            for record in batch.to_pylist():
                row_no += 1
                yield f"{path} row {row_no}", record
    except (pa.ArrowException, OSError) as e:
        raise RLHFError(f"{path}: not a readable Parquet file ({e})") from None


def _datasets_folder_files(folder: Path, split: str | None) -> list[Path]:
    """The Arrow files of a folder written by `datasets`' save_to_disk (a Dataset, or one split
    of a DatasetDict)."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        if split is None and len(splits) != 1:
            raise RLHFError(f"{folder} holds the splits {splits}; choose one with --split")
        chosen: str = split or splits[0]
        if chosen not in splits:
            raise RLHFError(f"{folder} has no split {chosen!r}; it holds {splits}")
        folder = folder / chosen
    elif split is not None:
        raise RLHFError(f"--split {split}: {folder} is a single dataset, not a DatasetDict")
    if not (folder / "state.json").is_file():
        raise RLHFError(f"{folder} is not a Hugging Face datasets folder (no state.json or "
                        f"dataset_dict.json): write it with Dataset.save_to_disk, or give "
                        f".jsonl / .parquet files")
    state = json.loads((folder / "state.json").read_text())
    return [folder / entry["filename"] for entry in state["_data_files"]]


def _datasets_folder_records(folder: Path, split: str | None) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa  # noqa: PLC0415

    row_no = 0
    for file in _datasets_folder_files(folder, split):
        with pa.memory_map(str(file)) as source:  # save_to_disk writes Arrow IPC streams
            for batch in pa.ipc.open_stream(source):
                for record in batch.to_pylist():
                    row_no += 1
                    yield f"{folder} row {row_no}", record


def input_records(path: str | Path, *, split: str | None = None) -> Iterator[tuple[str, Any]]:
    """(location, record) of every row of a .jsonl or .parquet file or a `datasets` folder."""
    path = Path(path)
    if not path.exists():
        raise RLHFError(f"input {str(path)!r} does not exist (relative paths start at the "
                        f"working directory {str(Path.cwd())!r})")
    if path.is_dir():
        return _datasets_folder_records(path, split)
    if path.suffix == ".parquet":  # streamed in record batches, never read whole
        return _parquet_records(path)
    return file_records([path])


def _chunks(inputs: Sequence[str | Path], split: str | None
            ) -> Iterator[list[tuple[str, Any]]]:
    chunk: list[tuple[str, Any]] = []
    for path in inputs:
        for item in input_records(path, split=split):
            chunk.append(item)
            if len(chunk) == CHUNK_ROWS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


# ---- tokenising a chunk ----------------------------------------------------------------------

@dataclass
class Chunk:
    """One chunk's rows, tokenised: what the parent appends to the files."""

    ids: np.ndarray  # (tokens,) int64, the rows end to end
    lengths: np.ndarray  # (rows,) int64
    mask: np.ndarray | None  # sft: (tokens,) uint8
    lines: bytes  # prompts: one JSON line per row
    line_lengths: np.ndarray  # (rows,) int64 bytes per line
    max_prompt_length: int


def tokenise_chunk(rows: list[tuple[str, Any]], tokenizer, job: Job) -> Chunk:
    """Check and tokenise one chunk's rows as `job.kind` asks."""
    lines: list[bytes] = []
    if job.kind == PROMPTS:
        checked = [check_row(record, where, prompt_key=job.prompt_key,
                             ground_truth_key=job.ground_truth_key) for where, record in rows]
        ids = tokenize_prompts(checked, tokenizer)
        masks = None
        for row in checked:
            fields = {"raw_prompt": question_text(row.prompt), "ground_truth": row.ground_truth,
                      "extra": row.extra, "location": row.location}
            try:
                lines.append(json.dumps(fields, ensure_ascii=False).encode() + b"\n")
            except TypeError as e:
                raise RLHFError(f"{row.location}: a field is not JSON ({e}); give plain "
                                f"strings, numbers, lists and objects") from None
        prompts = [len(row) for row in ids]
    else:
        keys = SFTKeys(prompt_key=job.prompt_key, response_key=job.response_key,
                       messages_key=job.messages_key)
        samples = sft_row_tokens(rows, tokenizer, keys)
        ids = [row for row, _ in samples]
        masks = [mask for _, mask in samples]
        prompts = [mask.index(True) for mask in masks]
    lengths = np.array([len(row) for row in ids], dtype=np.int64)
    for (where, _), length in zip(rows, lengths):
        if length == 0:
            raise RLHFError(f"{where}: the row tokenises to no tokens")
    return Chunk(ids=np.fromiter((t for row in ids for t in row), dtype=np.int64,
                                 count=int(lengths.sum())),
                 lengths=lengths,
                 mask=(None if masks is None else
                       np.fromiter((m for row in masks for m in row), dtype=np.uint8,
                                   count=int(lengths.sum()))),
                 lines=b"".join(lines),
                 line_lengths=np.array([len(line) for line in lines], dtype=np.int64),
                 max_prompt_length=max(prompts))


def load_tokenizer(path: str):
    """The Hugging Face tokenizer of a local folder."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - slow import, only when used

    if not Path(path).is_dir():
        raise RLHFError(f"tokenizer folder {path!r} does not exist; give --tokenizer a local "
                        f"folder (the model's, or model.tokenizer_path)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# One tokenizer per pool process, loaded once by the pool's initializer (a task would otherwise
# pickle it every time); only the worker processes ever set it.
_worker: dict[str, Any] = {}


def _init_worker(job: Job) -> None:
    _worker["tokenizer"], _worker["job"] = load_tokenizer(job.tokenizer_path), job


def _work(rows: list[tuple[str, Any]]) -> Chunk:
    return tokenise_chunk(rows, _worker["tokenizer"], _worker["job"])


# ---- writing the folder ----------------------------------------------------------------------

def preprocess(inputs: Sequence[str | Path], out: str | Path, job: Job, *, workers: int = 1,
               split: str | None = None, overwrite: bool = False,
               progress: bool = True) -> dict[str, Any]:
    """Tokenise `inputs` into the indexed dataset `out`; returns its manifest."""
    out = Path(out)
    if job.kind not in KINDS:
        raise RLHFError(f"--kind {job.kind!r}: use one of {', '.join(KINDS)}")
    if not inputs:
        raise RLHFError("no inputs given; name .jsonl / .parquet files or datasets folders")
    if out.exists() and not overwrite:
        raise RLHFError(f"{out} already exists; delete it, pass --overwrite or choose another "
                        f"--out")
    if workers < 1:
        raise RLHFError(f"--workers must be at least 1, got {workers}")
    tokenizer = load_tokenizer(job.tokenizer_path)
    dtype = token_dtype(len(tokenizer))
    fingerprint = tokenizer_fingerprint(tokenizer)
    fingerprint["name"] = str(job.tokenizer_path)
    start = time.perf_counter()
    with atomic_folder(out) as tmp:
        try:
            totals = _write_rows(tmp, inputs, job, tokenizer, dtype=dtype, workers=workers,
                                 split=split, progress=progress)
        except RLHFError as e:
            raise RLHFError(_with_flags(str(e), job)) from None
        manifest = {"format": FORMAT, "kind": job.kind, **totals, "dtype": dtype.name,
                    "tokenizer": fingerprint, "sources": [str(p) for p in inputs],
                    "split": split, "keys": {k: v for k, v in asdict(job).items()
                                             if k.endswith("_key")},
                    "seconds": round(time.perf_counter() - start, 3)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _with_flags(message: str, job: Job) -> str:
    """A row check's message with the config keys it names as this command's flags."""
    answer = "--response-key" if job.kind == SFT else "--ground-truth-key"
    return (message.replace("set data.prompt_key", "pass --prompt-key")
            .replace("set data.ground_truth_key", f"pass {answer}"))


def _write_rows(tmp: Path, inputs, job: Job, tokenizer, *, dtype: np.dtype, workers: int,
                split: str | None, progress: bool) -> dict[str, int]:
    from tqdm import tqdm  # noqa: PLC0415

    lengths: list[np.ndarray] = []
    line_lengths: list[np.ndarray] = []
    max_prompt = 0
    files = {TOKENS: open(tmp / TOKENS, "wb")}
    if job.kind == SFT:
        files[LOSS_MASK] = open(tmp / LOSS_MASK, "wb")
    else:
        files[ROWS] = open(tmp / ROWS, "wb")
    bar = tqdm(unit=" rows", disable=not progress, file=sys.stderr, desc=f"preprocess {job.kind}")
    try:
        for chunk in _tokenised(inputs, job, tokenizer, workers=workers, split=split):
            if chunk.ids.size and int(chunk.ids.max()) > np.iinfo(dtype).max:
                raise RLHFError(f"a token id {int(chunk.ids.max())} does not fit {dtype.name}; "
                                f"the tokenizer's vocabulary is larger than it reports")
            files[TOKENS].write(chunk.ids.astype(dtype).tobytes())
            if chunk.mask is not None:
                files[LOSS_MASK].write(chunk.mask.tobytes())
            else:
                files[ROWS].write(chunk.lines)
                line_lengths.append(chunk.line_lengths)
            lengths.append(chunk.lengths)
            max_prompt = max(max_prompt, chunk.max_prompt_length)
            bar.update(len(chunk.lengths))
    finally:
        bar.close()
        for f in files.values():
            f.close()
    rows = int(sum(len(a) for a in lengths))
    if rows == 0:
        raise RLHFError(f"the inputs {[str(p) for p in inputs]} hold no rows")
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
    np.save(tmp / OFFSETS, offsets)
    if line_lengths:
        np.save(tmp / ROW_OFFSETS,
                np.concatenate([[0], np.cumsum(np.concatenate(line_lengths))]).astype(np.int64))
    return {"rows": rows, "tokens": int(offsets[-1]), "max_prompt_length": max_prompt}


def _tokenised(inputs, job: Job, tokenizer, *, workers: int, split: str | None
               ) -> Iterator[Chunk]:
    """Each chunk tokenised, in input order; at most 2 x workers chunks in flight, so memory
    stays bounded however large the inputs."""
    chunks = _chunks(inputs, split)
    if workers == 1:
        for rows in chunks:
            yield tokenise_chunk(rows, tokenizer, job)
        return
    # spawn, not fork: a child forked from a process with other threads (a Ray driver's, a
    # progress bar's monitor) inherits whatever locks they held at that instant and the
    # caller's signal handlers, and can wait forever on one (seen: a worker that outlived the
    # pool's SIGTERM under a Ray driver). A fresh interpreter costs a few seconds of imports.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(job,)) as pool:
        pending: deque = deque()
        for rows in chunks:
            pending.append(pool.apply_async(_work, (rows,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
