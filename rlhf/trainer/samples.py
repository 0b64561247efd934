"""The sample table of a step (trainer.samples_every): the samples behind the step's numbers.

One row per chosen sample: its prompt and response, total reward and each reward function's
own score (and the environment's and the reward model's), mean advantage, response length,
whether it was truncated, and its mean log-prob gap (trainer minus sampler) when the sampler's
log-probs are known. The rows are the step's lowest and highest rewarded samples, so a table
shows what the reward punishes and what it pays for (reward hacking shows in the best rows),
not just the batch's first prompts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlhf.data.batch import Batch
from rlhf.data.fields import response_mask

FUNCTION_SCORE = "reward_fn/"
"""Prefix of the per-sample (n,) float32 fields holding each reward function's own score
(put there by the driver's scoring, rlhf.trainer.ppo), which sample tables show."""


# The other parts of a total reward, each a per-sample field: environment, reward model.
OTHER_SCORES = {"env_reward": "reward/env", "rm_scores": "reward/model"}


def chosen_rows(scores_N: Tensor, rows: int) -> list[tuple[int, str]]:
    """(sample index, "worst" | "best") of the `rows // 2` lowest and the rest highest
    rewarded samples; each sample at most once, worst first, ties by index."""
    order = sorted(range(len(scores_N)), key=lambda i: (float(scores_N[i]), i))
    rows = min(rows, len(order))
    low = order[:rows // 2]
    high = [i for i in reversed(order) if i not in low][:rows - len(low)]
    return [(i, "worst") for i in low] + [(i, "best") for i in high]


def sample_table(batch: Batch, scores_N: Tensor, decode: Callable[[Batch], list[str]], *,
                 truncated_N: Tensor, rows: int) -> list[dict]:
    """The rows of the step's sample table (see the module docstring); `decode` gives the
    response texts of a batch, `truncated_N` the truncation flags of `batch`'s samples."""
    lengths = batch["response_ids"].lengths
    mask = response_mask(batch)
    adv = _row_means(batch["advantages"], mask) if "advantages" in batch else None
    gap = (_row_means(batch["old_log_probs"], mask, minus=batch["rollout_log_probs"])
           if "rollout_log_probs" in batch and "old_log_probs" in batch else None)
    functions = [k for k in batch.keys() if k.startswith(FUNCTION_SCORE)]
    chosen = chosen_rows(scores_N, rows)
    responses = decode(batch.select([i for i, _ in chosen])) if chosen else []
    out = []
    for (i, kind), response in zip(chosen, responses):
        row = {"index": i, "kind": kind, "prompt": batch["raw_prompt"][i],
               "response": response, "reward": float(scores_N[i])}
        row.update({"reward/" + k.removeprefix(FUNCTION_SCORE): float(batch[k][i])
                    for k in functions})
        row.update({name: float(batch[field][i]) for field, name in OTHER_SCORES.items()
                    if field in batch})
        row.update(advantage=None if adv is None else float(adv[i]),
                   length=int(lengths[i]), truncated=bool(truncated_N[i]),
                   logprob_gap=None if gap is None else float(gap[i]))
        out.append(row)
    return out


def _row_means(values, mask, *, minus=None) -> Tensor:
    """(N,) mean over each response's counted tokens of `values` (or |values - minus|)."""
    v = values.values.double()
    if minus is not None:
        v = (v - minus.values.double()).abs()
    keep = mask.values.to(v.dtype)
    rows = torch.repeat_interleave(torch.arange(len(values.lengths)), values.lengths)
    sums = torch.zeros(len(values.lengths), dtype=v.dtype).index_add_(0, rows, v * keep)
    counts = torch.zeros(len(values.lengths), dtype=v.dtype).index_add_(0, rows, keep)
    return sums / counts.clamp(min=1)
