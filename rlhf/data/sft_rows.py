"""SFT rows as token ids with a per-token loss mask: prompt/answer pairs and chat transcripts.

A prompt/answer row (sft.prompt_key, sft.response_key) is its prompt, rendered as RL prompts are
(rlhf.data.dataset.tokenize_prompts), then the answer's tokens and EOS; only the answer and EOS
count. A transcript row (sft.messages_key: system / user / assistant / tool messages) is
rendered whole with the chat template, and only the assistant turns count: the text each adds
after the generation prompt (its content and end of turn), never the user's, tool's or
system's. A sample splits at its first counted token into prompt_ids and response_ids, as the
RL path packs them, with the mask as response_mask.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlhf.data.batch import Batch
from rlhf.data.blend import Rows, open_datasets
from rlhf.data.dataset import _check_messages, check_row, file_records, tokenize_prompts
from rlhf.data.fields import MASK
from rlhf.data.indexed import SFT, IndexedDataset, KeptRows, is_indexed
from rlhf.data.ragged import Ragged
from rlhf.errors import RLHFError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTKeys:
    """Which fields of a row hold the prompt, the answer and a whole chat transcript."""

    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str = "messages"


def _render(tokenizer, messages: list[dict], where: str, *, generation: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation,
                                             tokenize=False)
    except Exception as e:  # template errors are jinja's own types; name the row
        raise RLHFError(f"{where}: the chat template failed on this transcript: "
                        f"{type(e).__name__}: {e}") from None


def transcript_tokens(messages: list[dict], tokenizer, where: str) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered transcript and, per token, whether it is an assistant turn's."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RLHFError(f"{where}: a chat transcript needs a tokenizer with a chat template")
    text = _render(tokenizer, messages, where, generation=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # The assistant's turn is what its message adds to the transcript before it with the
        # generation prompt: the tokens the policy writes at that point, end of turn included.
        before = _render(tokenizer, messages[:k], where, generation=True)
        upto = _render(tokenizer, messages[:k + 1], where, generation=False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise RLHFError(f"{where}: the chat template does not render message {k} as an "
                            f"extension of the messages before it (some templates rewrite "
                            f"earlier turns), so its tokens cannot be told apart; use a "
                            f"template whose renderings of a transcript's prefixes are prefixes")
        spans.append((len(before), len(upto)))
    if not spans:
        raise RLHFError(f"{where}: the transcript has no assistant message to learn from")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    # A token counts when its text overlaps an assistant span (one straddling the header's
    # end counts: the model writes it).
    mask = [any(start < end_span and end > start_span for start_span, end_span in spans)
            for start, end in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def sft_row_tokens(records: Sequence[tuple[str, Any]], tokenizer, keys: SFTKeys
                   ) -> list[tuple[list[int], list[bool]]]:
    """(ids, loss mask) of each (location, record): a transcript when it has keys.messages_key,
    else a prompt/answer pair; RLHFError naming the row when it is neither."""
    out: list[tuple[list[int], list[bool]] | None] = [None] * len(records)
    pairs = []  # (position, PromptRow) of the prompt/answer rows, tokenised together
    for i, (where, record) in enumerate(records):
        if isinstance(record, dict) and keys.messages_key in record:
            messages = record[keys.messages_key]
            if not isinstance(messages, list):
                raise RLHFError(f"{where}: {keys.messages_key!r} must be a list of {{role, "
                                f"content}} messages, got {type(messages).__name__}")
            _check_messages(messages, where, keys.messages_key)
            out[i] = transcript_tokens(messages, tokenizer, where)
        else:
            pairs.append((i, check_row(record, where, prompt_key=keys.prompt_key,
                                       ground_truth_key=keys.response_key)))
    if pairs:
        if tokenizer.eos_token_id is None:
            raise RLHFError("the tokenizer has no eos token; SFT appends it to every answer")
        rows = [row for _, row in pairs]
        prompts = tokenize_prompts(rows, tokenizer)
        answers = tokenizer([str(row.ground_truth) for row in rows],
                            add_special_tokens=False)["input_ids"]
        for (i, _), prompt, answer in zip(pairs, prompts, answers):
            response = [*answer, tokenizer.eos_token_id]
            out[i] = ([*prompt, *response], [False] * len(prompt) + [True] * len(response))
    for (where, _), row in zip(records, out):
        assert row is not None
        if row[1][0]:
            raise RLHFError(f"{where}: the first token is trained on; the sample needs a prompt "
                            f"of at least one token (a BOS is enough) to predict it from")
    return out  # type: ignore[return-value]


def prompt_length(mask: np.ndarray) -> int:
    """Tokens before the first counted one: the sample's prompt."""
    return int(np.argmax(mask))


def sft_batch(ids_rows: Sequence[np.ndarray], mask_rows: Sequence[np.ndarray],
              indices: Tensor) -> Batch:
    """A Batch of prompt_ids, response_ids and response_mask (the loss mask past the prompt)
    of the given rows, `index` holding `indices`."""
    prompts, responses, masks = [], [], []
    for ids, mask in zip(ids_rows, mask_rows):
        p = prompt_length(mask)
        ids_t = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        prompts.append(ids_t[:p])
        responses.append(ids_t[p:])
        masks.append(torch.from_numpy(np.asarray(mask[p:], dtype=np.bool_)))
    return Batch({"prompt_ids": Ragged.from_list(prompts, dtype=torch.int64),
                  "response_ids": Ragged.from_list(responses, dtype=torch.int64),
                  MASK: Ragged.from_list(masks, dtype=torch.bool),
                  "index": indices.to(torch.int64)})


class SFTDataset:
    """Tokenised SFT samples held in memory (JSONL / Parquet rows); `batch` as the loader asks.

    Samples whose prompt (the tokens before the first counted one) is longer than
    max_prompt_length are dropped and counted in num_filtered.
    """

    def __init__(self, records: Sequence[tuple[str, Any]], tokenizer, *, keys: SFTKeys,
                 max_prompt_length: int):
        samples = sft_row_tokens(records, tokenizer, keys)
        kept = [(ids, mask) for ids, mask in samples
                if prompt_length(np.asarray(mask)) <= max_prompt_length]
        self.num_filtered = len(samples) - len(kept)
        if self.num_filtered:
            logger.warning("dropped %d of %d SFT samples whose prompt is longer than %d tokens "
                           "(data.max_prompt_length)", self.num_filtered, len(samples),
                           max_prompt_length)
        if not kept:
            raise RLHFError("the SFT dataset is empty: " + (
                f"every prompt is longer than {max_prompt_length} tokens" if samples
                else "the files hold no rows"))
        self.ids = [np.asarray(ids, dtype=np.int64) for ids, _ in kept]
        self.mask = [np.asarray(mask, dtype=np.bool_) for _, mask in kept]

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, indices: Tensor) -> Batch:
        """The samples at indices (int64), in that order."""
        idx = indices.tolist()
        return sft_batch([self.ids[i] for i in idx], [self.mask[i] for i in idx], indices)


class IndexedSFTDataset(KeptRows):
    """An sft dataset folder, read by memory map, with SFTDataset's interface."""

    def __init__(self, folder: str | Path, tokenizer, *, max_prompt_length: int):
        super().__init__(IndexedDataset(folder, kind=SFT, tokenizer=tokenizer),
                         max_prompt_length, filter_overlong=True)

    def batch(self, indices: Tensor) -> Batch:
        """The samples at indices (int64), in that order."""
        rows = self.rows(indices)
        return sft_batch([self.data.row_ids(i) for i in rows],
                         [self.data.row_mask(i) for i in rows], indices)


def build_sft_dataset(sft, tokenizer, *, max_prompt_length: int, seed: int
                      ) -> SFTDataset | Rows:
    """The samples of an SFTConfig's train_files: JSONL / Parquet rows tokenised in memory, or
    preprocessed folders read by memory map (several, or sft.train_weights, blended)."""
    if any(is_indexed(f) for f in sft.train_files):
        return open_datasets(
            list(sft.train_files), sft.train_weights, seed=seed, what="sft",
            open_one=lambda f: IndexedSFTDataset(f, tokenizer,
                                                 max_prompt_length=max_prompt_length))
    if sft.train_weights:
        raise RLHFError("sft.train_weights blend preprocessed folders; make them with "
                        "`rlhf preprocess-data --kind sft` and list the folders in "
                        "sft.train_files")
    keys = SFTKeys(prompt_key=sft.prompt_key, response_key=sft.response_key,
                   messages_key=sft.messages_key)
    return SFTDataset(list(file_records(sft.train_files)), tokenizer, keys=keys,
                      max_prompt_length=max_prompt_length)
