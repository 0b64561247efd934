"""Indexed token datasets: tokenised once by `rlhf preprocess-data`, read by memory map.

A dataset is a folder:

    manifest.json     format, kind (prompts | sft), rows, tokens, token dtype, longest prompt, the
                      tokenizer's fingerprint, the sources and keys; written last
    tokens.bin        every row's token ids, end to end (uint16 below 65,536 ids, else uint32)
    offsets.npy       int64 (rows + 1,): row i is tokens[offsets[i]:offsets[i + 1]]
    loss_mask.bin     sft: uint8 per token, 1 where the loss counts
    rows.jsonl        prompts: one JSON object per row, the fields the reward functions read
    rows_offsets.npy  prompts: int64 (rows + 1,) byte offsets of rows.jsonl's lines

Opening one maps the files and reads the manifest: start-up time and memory do not grow with
the rows; a batch reads only its rows' bytes. The other fields of a prompt row are JSON lines
rather than a column store because the ground truth is any JSON value (a number, a list, a
nested object) that differs in type from row to row, and a byte offset reads row i alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.errors import RLHFError

logger = logging.getLogger(__name__)

FORMAT = "rlhf-indexed/1"
MANIFEST, TOKENS, OFFSETS = "manifest.json", "tokens.bin", "offsets.npy"
LOSS_MASK, ROWS, ROW_OFFSETS = "loss_mask.bin", "rows.jsonl", "rows_offsets.npy"
PROMPTS, SFT = "prompts", "sft"
KINDS = (PROMPTS, SFT)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    """The tokenizer's name, vocabulary size and hashes of its vocabulary and chat template:
    two tokenizers that tokenise or render differently get different fingerprints."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(),
                                                                     sort_keys=True)
    specials = json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id,
                           tokenizer.pad_token_id])
    template = getattr(tokenizer, "chat_template", None)
    return {"name": str(getattr(tokenizer, "name_or_path", "") or "unnamed"),
            "vocab_size": len(tokenizer),
            "sha256": hashlib.sha256((model + specials).encode()).hexdigest(),
            "chat_template_sha256": (hashlib.sha256(template.encode()).hexdigest()
                                     if isinstance(template, str) else None)}


def is_indexed(path: str | Path) -> bool:
    """Whether a data path names an indexed dataset (a folder) rather than a file."""
    return Path(path).is_dir()


def check_tokenizer(folder: Path, recorded: dict, tokenizer) -> None:
    """RLHFError naming both tokenizers when `tokenizer` is not the one the folder was made with."""
    mine = tokenizer_fingerprint(tokenizer)
    differ = [what for key, what in (("sha256", "vocabulary"),
                                     ("chat_template_sha256", "chat template"))
              if recorded.get(key) != mine[key]]
    if differ:
        raise RLHFError(f"{folder} was tokenised with {recorded.get('name')!r} but this job's "
                        f"tokenizer is {mine['name']!r}, whose {' and '.join(differ)} differ; "
                        f"run `rlhf preprocess-data ... --tokenizer {mine['name']}` again to "
                        f"make the dataset for this tokenizer")


class IndexedDataset:
    """The memory-mapped files of one indexed dataset folder; `kind` must match its manifest."""

    def __init__(self, folder: str | Path, *, kind: str, tokenizer=None):
        self.folder = folder = Path(folder)
        if not (folder / MANIFEST).is_file():
            raise RLHFError(f"{folder} is not a complete indexed dataset (no {MANIFEST}): make "
                            f"it with `rlhf preprocess-data`; a run that was stopped leaves only "
                            f"a hidden temporary folder beside it")
        self.manifest = manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            raise RLHFError(f"{folder}: format {manifest.get('format')!r}, expected {FORMAT!r}; "
                            f"make it again with this version's `rlhf preprocess-data`")
        if manifest["kind"] != kind:
            raise RLHFError(f"{folder} is a {manifest['kind']!r} dataset but a {kind!r} one is "
                            f"needed here; preprocess the files with --kind {kind}")
        if tokenizer is not None:
            check_tokenizer(folder, manifest["tokenizer"], tokenizer)
        self.tokens = np.memmap(folder / TOKENS, dtype=np.dtype(manifest["dtype"]), mode="r",
                                shape=(manifest["tokens"],))
        self.offsets = np.load(folder / OFFSETS, mmap_mode="r")
        if len(self.offsets) != manifest["rows"] + 1:
            raise RLHFError(f"{folder}: {OFFSETS} holds {len(self.offsets) - 1} rows but the "
                            f"manifest says {manifest['rows']}; make the dataset again")
        self.loss_mask = (np.memmap(folder / LOSS_MASK, dtype=np.uint8, mode="r",
                                    shape=(manifest["tokens"],)) if kind == SFT else None)
        if kind == PROMPTS:
            self.row_bytes = np.memmap(folder / ROWS, dtype=np.uint8, mode="r")
            self.row_offsets = np.load(folder / ROW_OFFSETS, mmap_mode="r")

    def __len__(self) -> int:
        return int(self.manifest["rows"])

    def row_ids(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def row_mask(self, i: int) -> np.ndarray:
        assert self.loss_mask is not None
        return self.loss_mask[self.offsets[i]:self.offsets[i + 1]].astype(np.bool_)

    def record(self, i: int) -> dict:
        """The JSON fields of prompt row i."""
        start, stop = int(self.row_offsets[i]), int(self.row_offsets[i + 1])
        return json.loads(self.row_bytes[start:stop].tobytes())


def prompt_lengths(data: IndexedDataset) -> np.ndarray:
    """Every row's prompt length: the whole row of a prompts dataset, the tokens before the
    first counted one of an sft dataset (reads every file: O(tokens))."""
    lengths = np.diff(data.offsets)
    if data.loss_mask is None:
        return lengths
    counted = np.flatnonzero(data.loss_mask)  # every row has one (preprocess-data checks)
    starts = np.asarray(data.offsets[:-1])
    return counted[np.searchsorted(counted, starts)] - starts


def keep_short(data: IndexedDataset, limit: int, *, filter_overlong: bool
                ) -> np.ndarray | None:
    """Indices of the rows whose prompt is at most `limit` tokens, or None when all are (the
    manifest says so without reading the index)."""
    if data.manifest["max_prompt_length"] <= limit:
        return None
    keep = np.flatnonzero(prompt_lengths(data) <= limit)
    dropped = len(data) - len(keep)
    if not filter_overlong:
        raise RLHFError(f"{data.folder}: {dropped} prompts are longer than "
                        f"data.max_prompt_length={limit} tokens; raise it or set "
                        f"data.filter_overlong_prompts: true to drop them")
    logger.warning("%s: dropped %d of %d prompts longer than %d tokens (data.max_prompt_length)",
                   data.folder, dropped, len(data), limit)
    if not len(keep):
        raise RLHFError(f"{data.folder}: every prompt is longer than {limit} tokens "
                        f"(data.max_prompt_length)")
    return keep.astype(np.int64)


class KeptRows:
    """An indexed folder less its rows over max_prompt_length: the datasets' shared part."""

    def __init__(self, data: IndexedDataset, max_prompt_length: int, *, filter_overlong: bool):
        self.data = data
        self.keep = keep_short(data, max_prompt_length, filter_overlong=filter_overlong)
        self.num_filtered = 0 if self.keep is None else len(data) - len(self.keep)

    def __len__(self) -> int:
        return len(self.data) if self.keep is None else len(self.keep)

    def rows(self, indices: Tensor) -> list[int]:
        """The folder's row numbers of dataset indices (int64)."""
        return indices.tolist() if self.keep is None else self.keep[indices.numpy()].tolist()


class IndexedPromptDataset(KeptRows):
    """A prompts dataset folder, read by memory map, with PromptDataset's interface."""

    def __init__(self, folder: str | Path, tokenizer, *, max_prompt_length: int,
                 filter_overlong: bool = True):
        super().__init__(IndexedDataset(folder, kind=PROMPTS, tokenizer=tokenizer),
                         max_prompt_length, filter_overlong=filter_overlong)

    def batch(self, indices: Tensor) -> Batch:
        """A Batch of the samples at indices (int64), in that order."""
        rows = self.rows(indices)
        records = [self.data.record(i) for i in rows]
        ids = [torch.from_numpy(self.data.row_ids(i).astype(np.int64)) for i in rows]
        return Batch({
            "prompt_ids": Ragged.from_list(ids, dtype=torch.int64),
            "raw_prompt": [r["raw_prompt"] for r in records],
            "ground_truth": [r["ground_truth"] for r in records],
            "data_source": [r["extra"]["data_source"] for r in records],
            "extra": [r["extra"] for r in records],
            "index": indices.to(torch.int64),
        })
