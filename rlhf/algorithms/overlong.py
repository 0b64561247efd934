"""DAPO's overlong handling: a soft length penalty near the generation limit, and which
responses were cut by the limit (to mask them out of the loss)."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths_N: Tensor, *, max_new_tokens: int, buffer: int,
                     penalty: float) -> Tensor:
    """(n,) float32 score shaping, <= 0: 0 up to max_new_tokens - buffer tokens, then falling
    linearly to -penalty at max_new_tokens (and staying there beyond). buffer 0 = off (zeros)."""
    if buffer < 0 or buffer > max_new_tokens:
        raise ValueError(f"the overlong buffer must lie in [0, {max_new_tokens}] "
                         f"(max_new_tokens), got {buffer}")
    lengths_N = lengths_N.to(torch.float32)
    if buffer == 0:
        return torch.zeros_like(lengths_N)
    over_N = (lengths_N - (max_new_tokens - buffer)).clamp(0, buffer)
    return -penalty * over_N / buffer


def truncated(lengths_N: Tensor, last_token_N: Tensor, *, max_new_tokens: int,
              eos_token_id: int | None) -> Tensor:
    """(n,) bool: the response reached max_new_tokens and its last token is not EOS, so the
    limit (not the model) ended it. `last_token_N` is each response's last token id (any value
    for an empty response, which is never truncated)."""
    hit_N = lengths_N >= max_new_tokens
    if eos_token_id is None:
        return hit_N
    return hit_N & (last_token_N != eos_token_id)
