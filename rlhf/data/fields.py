"""Field helpers that the driver and the workers both read: one definition of the loss mask."""

from __future__ import annotations

import torch

from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged

MASK = "response_mask"
"""Optional per-response-token bool field: False tokens count in no loss and no metric."""
MODEL_MASK = "model_mask"
"""Per-response-token bool field of multi-turn episodes: True where the model sampled the
token, False on environment (observation) tokens, which are context only."""

SEQ_IS_WEIGHTS = "seq_is_weights"
"""Optional per-response-token float field: the driver's sequence-level rollout-correction
weight of each response, repeated on its tokens; the actor scales the policy loss by it."""


def response_mask(batch: Batch) -> Ragged:
    """The tokens that count: `response_mask` and `model_mask` where present (as bool), else
    every response token."""
    responses = batch["response_ids"]
    mask_T = torch.ones(responses.values.shape[0], dtype=torch.bool)
    for key in (MASK, MODEL_MASK):
        if key in batch:
            if not torch.equal(batch[key].offsets, responses.offsets):
                raise ValueError(f"{key} has different row lengths than response_ids")
            mask_T = mask_T & batch[key].values.bool()
    return Ragged(mask_T, responses.offsets)


def sample_lengths(batch: Batch) -> list[int]:
    """Packed length (prompt + response tokens) of every sample: what micro-batches are cut by."""
    return (batch["prompt_ids"].lengths + batch["response_ids"].lengths).tolist()
