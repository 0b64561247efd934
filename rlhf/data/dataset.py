"""Prompt datasets from JSONL and Parquet files, tokenised once, and a resumable batch loader.

A row holds the prompt (data.prompt_key: a string, or a chat as a list of {role, content}
messages), the ground truth (data.ground_truth_key: any JSON value, handed to the reward
functions as is), an optional data_source string and any other fields, kept as `extra`.
Either key may be dotted to reach into nested objects: verl's rows keep the answer in
`reward_model.ground_truth` and are read as they are with that key.
With a chat template the prompt is rendered with add_generation_prompt=True (a string
becomes one user message) and encoded without adding special tokens again; without one, a
string prompt is encoded plainly (with the tokenizer's usual special tokens). Folders made by
`rlhf preprocess-data` are read by memory map instead (rlhf.data.indexed, rlhf.data.blend).
"""

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf.data.batch import Batch
from rlhf.data.blend import Rows, open_datasets
from rlhf.data.indexed import IndexedPromptDataset, is_indexed
from rlhf.data.ragged import Ragged
from rlhf.data.shuffle import ORDER, Permutation
from rlhf.errors import RLHFError

logger = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".parquet")
DEFAULT_DATA_SOURCE = "unknown"


@dataclass(frozen=True)
class PromptRow:
    """One checked row: prompt (text or chat messages), ground truth, data source, extras."""

    prompt: str | list[dict]
    ground_truth: Any
    data_source: str
    extra: dict
    """Every top-level field but those the prompt and the ground truth came from (data_source
    included; verl's extra_info stays whole under its name)."""
    location: str
    """Where the row came from, e.g. 'data/train.jsonl:12', for error messages."""


def _check_messages(messages: list, where: str, key: str) -> None:
    if not messages:
        raise RLHFError(f"{where}: {key!r} is an empty list; give at least one message")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise RLHFError(f"{where}: message {i} of {key!r} is {message!r:.120}; each message "
                            f"must be an object with string 'role' and 'content'")


_MISSING = object()
# Where verl's data preparation puts the answer; named in the error for such rows.
VERL_GROUND_TRUTH_KEY = "reward_model.ground_truth"


def field_at(record: dict, key: str) -> Any:
    """record[key] when the row has that field, else the value a dotted key reaches through
    nested objects ('reward_model.ground_truth'); _MISSING when neither exists."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _top_field(record: dict, key: str) -> str:
    """The row's top-level field a key reads from: itself, or a dotted key's first part."""
    return key if key in record else key.split(".")[0]


def _missing(record: dict, key: str, what: str, config_key: str) -> str:
    """Why `key` is not in the row: which part of a dotted key is absent, and what is there."""
    value: Any = record
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(value, dict):
            reached = ".".join(parts[:depth])
            return (f"no {key!r} field: {reached!r} is a {type(value).__name__}, not an object "
                    f"with a {part!r} field; set {config_key} to the field that holds {what}")
        if part not in value:
            inside = f"{'.'.join(parts[:depth])!r} has" if depth else "the row has"
            return (f"no {key!r} field ({inside} fields {sorted(value)}); set {config_key} to "
                    f"the field that holds {what} (a dotted key reaches a nested one)")
        value = value[part]
    raise AssertionError(f"{key!r} is present")  # callers ask only about missing keys


def check_row(record: Any, where: str, *, prompt_key: str, ground_truth_key: str) -> PromptRow:
    """A PromptRow from one parsed record, or RLHFError naming where and what is wrong."""
    if not isinstance(record, dict):
        raise RLHFError(f"{where}: expected a JSON object, got a {type(record).__name__}")
    prompt = field_at(record, prompt_key)
    if prompt is _MISSING:
        raise RLHFError(f"{where}: {_missing(record, prompt_key, 'the prompt', 'data.prompt_key')}")
    if isinstance(prompt, list):
        _check_messages(prompt, where, prompt_key)
    elif not isinstance(prompt, str):
        raise RLHFError(f"{where}: {prompt_key!r} must be a string or a list of "
                        f"{{role, content}} messages, got {type(prompt).__name__}")
    elif not prompt.strip():
        raise RLHFError(f"{where}: {prompt_key!r} is an empty string")
    ground_truth = field_at(record, ground_truth_key)
    if ground_truth is _MISSING:
        problem = _missing(record, ground_truth_key, "the answer", "data.ground_truth_key")
        if field_at(record, VERL_GROUND_TRUTH_KEY) not in (_MISSING, None):
            problem += (f"; this row has verl's layout: set data.ground_truth_key: "
                        f"{VERL_GROUND_TRUTH_KEY}")
        raise RLHFError(f"{where}: {problem}")
    if ground_truth is None:
        raise RLHFError(f"{where}: {ground_truth_key!r} is null; every row needs its answer")
    data_source = record.get("data_source")
    if data_source is None:
        data_source = DEFAULT_DATA_SOURCE
    elif not isinstance(data_source, str):
        raise RLHFError(f"{where}: 'data_source' must be a string, got "
                        f"{type(data_source).__name__}")
    taken = (_top_field(record, prompt_key), _top_field(record, ground_truth_key))
    extra = {k: v for k, v in record.items() if k not in taken}
    extra["data_source"] = data_source
    return PromptRow(prompt=prompt, ground_truth=ground_truth,
                     data_source=data_source, extra=extra, location=where)


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                text = raw.decode("utf-8").removeprefix("\ufeff")
            except UnicodeDecodeError as e:
                raise RLHFError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not text.strip():
                continue  # blank lines (a trailing newline, a gap) carry no row
            try:
                yield where, json.loads(text)
            except json.JSONDecodeError as e:
                raise RLHFError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa  # noqa: PLC0415 - only Parquet datasets need it
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise RLHFError(f"{path}: not a readable Parquet file ({e})") from None
    for row_no, record in enumerate(table.to_pylist(), start=1):
        yield f"{path} row {row_no}", record


def file_records(files: Sequence[str | Path]) -> Iterator[tuple[str, Any]]:
    """(location, parsed record) of every row of the JSONL and Parquet files, in order."""
    if not files:
        raise RLHFError("no data files given; list them in data.train_files / data.val_files")
    for file in map(Path, files):
        if file.suffix not in SUFFIXES:
            raise RLHFError(f"{file}: unsupported data file type {file.suffix!r}; use JSON Lines "
                            f"(.jsonl, one object per line) or Parquet (.parquet)")
        if not file.is_file():
            raise RLHFError(f"data file {str(file)!r} does not exist (relative paths start at "
                            f"the working directory {str(Path.cwd())!r})")
        yield from _jsonl_records(file) if file.suffix == ".jsonl" else _parquet_records(file)


def read_rows(files: Sequence[str | Path], *, prompt_key: str = "prompt",
              ground_truth_key: str = "ground_truth") -> list[PromptRow]:
    """Checked rows of the JSONL (.jsonl) and Parquet (.parquet) files, in order."""
    return [check_row(record, where, prompt_key=prompt_key, ground_truth_key=ground_truth_key)
            for where, record in file_records(files)]


def question_text(prompt: str | list[dict]) -> str:
    """The text reward functions see as `prompt`: the string, or the last user message's content."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m["role"] == "user"]
    return (users or prompt)[-1]["content"]


def tokenize_prompts(rows: Sequence[PromptRow], tokenizer) -> list[list[int]]:
    """Token ids of each row's prompt: chat template when the tokenizer has one, else plain."""
    if getattr(tokenizer, "chat_template", None) is None:
        for row in rows:
            if not isinstance(row.prompt, str):
                raise RLHFError(f"{row.location}: the prompt is a chat, but the tokenizer has no "
                                f"chat template; use string prompts or a tokenizer with one")
        return tokenizer([row.prompt for row in rows])["input_ids"] if rows else []
    texts = []
    for row in rows:
        messages = [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) \
            else row.prompt
        try:
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=False))
        except Exception as e:  # template errors are jinja's own types; name the row
            raise RLHFError(f"{row.location}: the chat template failed on this prompt: "
                            f"{type(e).__name__}: {e}") from None
    # The rendered text already holds the template's special tokens (e.g. bos).
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


class PromptDataset:
    """Tokenised prompts with their ground truths, data sources and extra fields.

    Prompts longer than max_prompt_length tokens are dropped and counted in num_filtered, or
    raise RLHFError when filter_overlong is False.
    """

    def __init__(self, rows: Sequence[PromptRow], tokenizer, *, max_prompt_length: int,
                 filter_overlong: bool = True):
        ids = tokenize_prompts(rows, tokenizer)
        keep = [i for i, row_ids in enumerate(ids) if len(row_ids) <= max_prompt_length]
        self.num_filtered = len(rows) - len(keep)
        if self.num_filtered and not filter_overlong:
            first = next(i for i, row_ids in enumerate(ids) if len(row_ids) > max_prompt_length)
            raise RLHFError(f"{rows[first].location}: the prompt is {len(ids[first])} tokens, "
                            f"longer than data.max_prompt_length={max_prompt_length} "
                            f"({self.num_filtered} such rows in all); raise max_prompt_length "
                            f"or set data.filter_overlong_prompts: true to drop them")
        if self.num_filtered:
            logger.warning("dropped %d of %d prompts longer than %d tokens "
                           "(data.max_prompt_length)", self.num_filtered, len(rows),
                           max_prompt_length)
        if not keep:
            reason = (f"all {len(rows)} prompts are longer than {max_prompt_length} tokens"
                      if rows else "the files hold no rows")
            raise RLHFError(f"the prompt dataset is empty: {reason}")
        kept = [rows[i] for i in keep]
        self.prompt_ids = Ragged.from_list([ids[i] for i in keep], dtype=torch.int64)
        self.raw_prompt = [question_text(row.prompt) for row in kept]
        self.ground_truth = [row.ground_truth for row in kept]
        self.data_source = [row.data_source for row in kept]
        self.extra = [row.extra for row in kept]
        self.locations = [row.location for row in kept]

    @classmethod
    def from_files(cls, files: Sequence[str | Path], tokenizer, *, prompt_key: str = "prompt",
                   ground_truth_key: str = "ground_truth", max_prompt_length: int = 512,
                   filter_overlong: bool = True) -> "PromptDataset":
        """Read, check and tokenise the rows of several JSONL / Parquet files, concatenated."""
        rows = read_rows(files, prompt_key=prompt_key, ground_truth_key=ground_truth_key)
        return cls(rows, tokenizer, max_prompt_length=max_prompt_length,
                   filter_overlong=filter_overlong)

    def __len__(self) -> int:
        return len(self.raw_prompt)

    def batch(self, indices: Tensor) -> Batch:
        """A Batch of the samples at indices (int64), in that order."""
        idx = indices.tolist()
        return Batch({
            "prompt_ids": self.prompt_ids.select(indices),
            "raw_prompt": [self.raw_prompt[i] for i in idx],
            "ground_truth": [self.ground_truth[i] for i in idx],
            "data_source": [self.data_source[i] for i in idx],
            "extra": [dict(self.extra[i]) for i in idx],  # copies: callers may edit them
            "index": indices.to(torch.int64),
        })


def build_prompt_dataset(files: Sequence[str | Path], tokenizer, data_cfg, *,
                         weights: Sequence[float] = ()) -> PromptDataset | Rows:
    """A PromptDataset of files, with the keys, length limit and filtering of a DataConfig;
    folders made by `rlhf preprocess-data` are read by memory map instead, several (or
    `weights`) blended."""
    if weights and not data_cfg.shuffle:
        raise RLHFError("data.train_weights with data.shuffle: false would visit the blended "
                        "datasets one after another; set data.shuffle: true to mix them")
    if any(is_indexed(f) for f in files):
        return open_datasets(
            [str(f) for f in files], weights, seed=data_cfg.seed, what="data",
            open_one=lambda f: IndexedPromptDataset(
                f, tokenizer, max_prompt_length=data_cfg.max_prompt_length,
                filter_overlong=data_cfg.filter_overlong_prompts))
    if weights:
        raise RLHFError("data.train_weights blend preprocessed folders; make them with "
                        "`rlhf preprocess-data` and list the folders in data.train_files")
    return PromptDataset.from_files(
        files, tokenizer, prompt_key=data_cfg.prompt_key,
        ground_truth_key=data_cfg.ground_truth_key, max_prompt_length=data_cfg.max_prompt_length,
        filter_overlong=data_cfg.filter_overlong_prompts)


STORED_ORDER = "numpy permutation"  # the order before rlhf.data.shuffle


class PromptLoader:
    """Endless iterator of Batches, epoch after epoch; exactly resumable via state_dict().

    Epoch e visits the samples in a permutation drawn from (seed, e) and computed batch by
    batch (rlhf.data.shuffle: no table that grows with the rows), or in order when shuffle is
    False; drop_last drops an epoch's final partial batch.
    """

    def __init__(self, dataset: PromptDataset | Rows, *, batch_size: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True):
        if batch_size < 1:
            raise RLHFError(f"batch_size must be at least 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise RLHFError(f"the dataset has {len(dataset)} prompts, fewer than one batch of "
                            f"{batch_size}; add data or lower the batch size")
        self.dataset, self.batch_size = dataset, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.position = 0, 0  # the next batch is batch `position` of `epoch`

    @property
    def batches_per_epoch(self) -> int:
        n, size = len(self.dataset), self.batch_size
        return n // size if self.drop_last else -(-n // size)

    def epoch_indices(self, epoch: int, start: int, stop: int) -> Tensor:
        """Dataset indices at positions start..stop-1 of the order epoch visits them (int64)."""
        n = len(self.dataset)
        if not self.shuffle:
            return torch.arange(start, min(stop, n), dtype=torch.int64)
        return torch.from_numpy(Permutation(n, seed=self.seed, epoch=epoch).take(start, stop))

    def __iter__(self) -> "PromptLoader":
        return self

    def __next__(self) -> Batch:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        indices = self.epoch_indices(self.epoch, start, start + self.batch_size)
        self.position += 1
        return self.dataset.batch(indices)

    def state_dict(self) -> dict:
        """Where the loader is, plus what must match for a resume to be exact."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "batch_size": self.batch_size,
                "drop_last": self.drop_last, "num_samples": len(self.dataset),
                "order": ORDER if self.shuffle else "in order"}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict(); the dataset and settings must be the ones it came from."""
        mine = self.state_dict()
        # Checkpoints from before the order was named drew it from numpy's permutation.
        state = {"order": STORED_ORDER if state.get("shuffle") else "in order", **state}
        differ = [f"{key}: saved {state.get(key)!r}, now {mine[key]!r}"
                  for key in ("seed", "shuffle", "batch_size", "drop_last", "num_samples",
                              "order") if state.get(key) != mine[key]]
        if differ:
            raise RLHFError(f"cannot resume the prompt loader exactly; these differ from the "
                            f"saved state: {'; '.join(differ)}"
                            + ("; the saved run visited its prompts in another order (an older "
                               "version's), so this one would read some twice and skip "
                               "others: finish it with that version or start afresh"
                               if state["order"] != mine["order"] else ""))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
