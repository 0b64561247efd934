"""Field helpers that the driver and the workers both read: one definition of the loss mask."""

from __future__ import annotations

import torch

from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged

MASK = "response_mask"
"""Optional per-response-token bool field: False tokens count in no loss and no metric."""

SEQ_IS_WEIGHTS = "seq_is_weights"
"""Optional per-response-token float field: the driver's sequence-level rollout-correction
weight of each response, repeated on its tokens; the actor scales the policy loss by it."""


def response_mask(batch: Batch) -> Ragged:
    """The batch's `response_mask` as bool, or all True over the response tokens."""
    responses = batch["response_ids"]
    if MASK in batch:
        return Ragged(batch[MASK].values.bool(), batch[MASK].offsets)
    return Ragged(torch.ones(responses.values.shape[0], dtype=torch.bool), responses.offsets)


def sample_lengths(batch: Batch) -> list[int]:
    """Packed length (prompt + response tokens) of every sample: what micro-batches are cut by."""
    return (batch["prompt_ids"].lengths + batch["response_ids"].lengths).tolist()
