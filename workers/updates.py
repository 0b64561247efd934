"""The worker side of a training update: algorithm.ppo_epochs passes over the plan's
mini-batches, one optimizer step each.

A role gives the loss (`make_loss(global_tokens, global_seqs)` -> the engine's loss_fn); the
loop here builds the micro-batches (workers/micro_batches.py), counts the mini-batch's tokens
and sequences over every DP rank so that the micro-batch losses add up to the mini-batch loss,
steps the engine and averages the metrics over the steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch import Tensor

from rlhf.config import JobConfig, TrainRoleConfig
from rlhf.data.batch import Batch
from rlhf.data.batch_split import GroupBatches
from rlhf.data.fields import MASK
from rlhf.engine import MicroBatch, TrainEngine
from workers.micro_batches import build_micro_batches, group_batches


def train_mini_batch(engine: TrainEngine, mbs: Sequence[MicroBatch], make_loss, *,
                     outputs: Sequence[str], temperature: float = 1.0) -> dict[str, float]:
    """One optimizer step on one mini-batch's micro-batches (this DP group's share); returns
    its metrics plus grad_norm and lr.

    `make_loss(global_tokens, global_seqs)` gives the engine's loss_fn; its metrics must be
    each micro-batch's SHARE of the mini-batch value (like the losses), so their sum over all
    micro-batches of all DP ranks is the mini-batch value. The engine averages metrics over
    those micro-batches, so the sum is that average times their number.
    """
    tokens, seqs = engine.loss_normalizers(mbs, mask_key=MASK)
    stats = engine.forward_backward(mbs, make_loss(max(tokens, 1), max(seqs, 1)),
                                    outputs=outputs, temperature=temperature)
    count = stats.pop("num_micro_batches")
    stats.pop("loss")
    metrics = {k: v * count for k, v in stats.items()}
    return {**metrics, **engine.step()}


def ppo_updates(engine: TrainEngine, batch: Batch, split: GroupBatches | None, config: JobConfig,
                key: str, per_token: Sequence[str], make_loss, *, outputs: Sequence[str],
                temperature: float = 1.0, on_policy: bool = False,
                replay_routes: bool = False) -> dict[str, float]:
    """algorithm.ppo_epochs passes over the plan's mini-batches (the driver's batch split, or this
    group's own at dp = 1: `<key>.ppo_mini_batch_size` prompts' samples each, in order), one
    `train_mini_batch` step each; metrics averaged over the steps, named `<key>/...`.
    `on_policy`: ValueError unless that is one step (the loss reads the old policy from it).
    `replay_routes`: an MoE model's forwards use the batch's recorded routes (if it has them)."""
    role: TrainRoleConfig = getattr(config, key)
    split = group_batches(batch, role, split, dp_size=engine.mesh.dp_size, key=key,
                          mini_size=role.ppo_mini_batch_size * config.rollout.n)
    steps = config.algorithm.ppo_epochs * len(split.mini_batches)
    if on_policy and steps != 1:
        raise ValueError(f"{key}: the batch has no old_log_probs, which the update can take from "
                         f"its first forward only when it is one step; this one is {steps} "
                         f"(algorithm.ppo_epochs x mini-batches): call compute_log_prob first")
    minis = [build_micro_batches(batch, micro, (*per_token, MASK),
                                 share_prompts=role.share_prompts, replay_routes=replay_routes)
             for micro in split.mini_batches]
    history = [train_mini_batch(engine, mbs, make_loss, outputs=outputs, temperature=temperature)
               for _ in range(config.algorithm.ppo_epochs) for mbs in minis]
    return mean_metrics(history, f"{key}/")


def token_share(mask_T: Tensor, global_tokens: int) -> Tensor:
    """This micro-batch's fraction of the mini-batch's counted tokens: the weight that turns a
    per-micro-batch token mean into its share of the mini-batch token mean."""
    return mask_T.sum() / global_tokens


def mean_metrics(history: Sequence[Mapping[str, float]], prefix: str) -> dict[str, float]:
    """Each metric averaged over the optimizer steps, named `prefix + name`."""
    keys = history[0].keys()
    return {prefix + k: math.fsum(h[k] for h in history) / len(history) for k in keys}
