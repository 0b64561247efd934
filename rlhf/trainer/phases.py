"""The driver-side pieces of one PPO step: rewards, advantages and batch statistics."""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algorithms import (apply_kl_penalty, compute_advantage, scores_to_token_rewards,
                             sequence_scores)
from rlhf.config import JobConfig
from rlhf.data.batch import Batch
from rlhf.data.fields import response_mask
from rlhf.data.ragged import Ragged
from rlhf.rewards import RewardRunner
from rlhf.rewards.runner import combine_scores


def step_seed(base: int, step: int) -> int:
    """The sampling seed of one step: a fixed function of (seed, step), so a resumed run
    samples exactly as an uninterrupted one would."""
    return (base * 1_000_003 + step * 7919) % 2**31


def decode_responses(batch: Batch, tokenizer) -> list[str]:
    """Response texts without special tokens (the EOS that stopped a response is dropped)."""
    return tokenizer.batch_decode([row.tolist() for row in batch["response_ids"].to_list()],
                                  skip_special_tokens=True)


def score_batch(batch: Batch, tokenizer, runner: RewardRunner, cfg: JobConfig, *,
                rm_scores: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """(N,) float32 total rewards (functions + environment + reward model) and the metrics."""
    result = runner.score(batch["raw_prompt"], decode_responses(batch, tokenizer),
                          batch["ground_truth"], batch["extra"])
    parts = [result.scores]
    if "env_reward" in batch:  # multi-turn episodes: the environment's summed rewards
        parts.append(batch["env_reward"])
    scores = combine_scores(parts, [1.0] * len(parts), rm_scores=rm_scores,
                            rm_weight=cfg.reward.model_weight)
    metrics = {**result.metrics, "reward/mean": scores.mean().item(),
               "reward/max": scores.max().item(), "reward/min": scores.min().item()}
    if "env_reward" in batch:
        metrics["reward/env_mean"] = batch["env_reward"].float().mean().item()
    if rm_scores is not None:
        metrics["reward/rm_mean"] = rm_scores.float().mean().item()
    return scores, metrics


def compute_advantages(batch: Batch, scores_N: Tensor, cfg: JobConfig,
                       kl_ctrl) -> tuple[Batch, dict[str, float]]:
    """`advantages` and `returns` (Ragged like response_ids) by algorithm.adv_estimator, with
    the in-reward KL penalty when algorithm.kl_in_reward (which also updates `kl_ctrl`)."""
    algo, responses = cfg.algorithm, batch["response_ids"]
    cu, mask_T = responses.offsets, response_mask(batch).values
    token_rewards_T = scores_to_token_rewards(scores_N.double(), cu, mask_T)
    metrics: dict[str, float] = {}
    if algo.kl_in_reward:
        token_rewards_T, kl_N = apply_kl_penalty(
            token_rewards_T, batch["old_log_probs"].values.double(),
            batch["ref_log_probs"].values.double(), mask_T, cu, coef=kl_ctrl.coef,
            kind=algo.kl_penalty)
        metrics["actor/kl_coef"] = kl_ctrl.coef
        metrics["reward/kl_penalty_mean"] = (kl_ctrl.coef * kl_N).mean().item()
        kl_ctrl.update(kl_N.mean().item(), len(batch))
    inputs = dict(token_rewards_T=token_rewards_T, cu_seqlens=cu, mask_T=mask_T)
    if algo.use_critic:
        inputs["values_T"] = batch["values"].values.double()
        inputs.update(gamma=algo.gamma, lam=algo.lam)
    elif algo.adv_estimator == "reinforce_plus_plus":
        inputs["gamma"] = algo.gamma
    else:  # group estimators score whole samples
        inputs["scores_N"] = sequence_scores(token_rewards_T, cu, mask_T)
        inputs["group_ids"] = torch.arange(len(batch) // cfg.rollout.n).repeat_interleave(
            cfg.rollout.n)
        if algo.adv_estimator == "grpo":
            inputs["norm_adv_by_std"] = algo.norm_adv_by_std
        del inputs["token_rewards_T"]
    advantages_T, returns_T = compute_advantage(algo.adv_estimator, **inputs)
    valid = mask_T.bool()
    if valid.any():
        metrics["advantages/mean"] = advantages_T[valid].mean().item()
        metrics["returns/mean"] = returns_T[valid].mean().item()
    out = Batch({"advantages": Ragged(advantages_T.float(), cu),
                 "returns": Ragged(returns_T.float(), cu)})
    return out, metrics


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Response lengths, tokens, and `actor/kl_ref`: the policy's KL to the reference before
    the update (k1 per token, old minus reference log-probs, token mean); the update's own
    policy-vs-old estimate is `actor/approx_kl`."""
    responses, mask_T = batch["response_ids"], response_mask(batch).values
    lengths = responses.lengths.float()
    metrics = {
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "prompt_length/mean": batch["prompt_ids"].lengths.float().mean().item(),
        "tokens/total": float(batch["prompt_ids"].values.numel() + responses.values.numel()),
    }
    if "entropy" in batch and mask_T.any():
        metrics["rollout/entropy"] = batch["entropy"].values[mask_T].mean().item()
    if "ref_log_probs" in batch and mask_T.any():
        diff = batch["old_log_probs"].values - batch["ref_log_probs"].values
        metrics["actor/kl_ref"] = diff[mask_T].mean().item()
    return metrics
