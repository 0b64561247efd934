"""The Batch fields the PPO driver and the worker roles exchange: who makes each, who reads
it, and the helpers both sides use (the loss mask, the packed lengths, the check that a call
has what it needs).

The driver plans (rlhf.data.batch_split): a role method takes `plan=`, the driver's BatchSplit;
the dispatcher hands DP group g the rows the plan gives it with its GroupBatches (mini-batches of
micro-batches, as indices into those rows) and puts results back in the driver's order. The
worker only executes the plan. Without one, a group plans its own contiguous chunk (forward
passes at any DP size; updates only at dp = 1). A role method returns a NEW Batch holding only
the fields it produced (on the CPU); the driver merges it: `batch = batch.union(result)`.

Per sample:
    prompt_ids         Ragged int64   prompt tokens; at least one (a BOS is enough), because
                                      the first response token is predicted from the last one
    response_ids       Ragged int64   sampled response tokens; may be empty
    rm_scores          (n,) float32   RewardModelWorker.compute_rm_score (workers/reward_model.py)
    reward_fn/<name>   (n,) float32   the driver's scoring: reward function <name>'s own score,
                                      which sample tables show (rlhf.trainer.samples)
    policy_version     (n,) int64     the driver (rlhf.trainer.rollout_source): the version of the
                                      weights that sampled it (actor updates before them)

Per response token (Ragged with the row lengths of `response_ids`; entry j of row i is about
response token j of sample i, computed at the position that predicts it):
    old_log_probs      float32  ActorWorker.compute_log_prob: log pi(token | prefix) at the
                                sampling temperature (rollout.temperature; 1 when greedy);
                                or, on-policy, update_actor's first forward (workers/actor.py)
    entropy            float32  the same pass: entropy of that distribution
    ref_log_probs      float32  ReferenceWorker.compute_ref_log_prob, same temperature
    values             float32  CriticWorker.compute_values: V(prompt + response[:j])
    advantages         float    the driver (rlhf.algorithms advantage estimators)
    returns            float    the driver (critic targets)
    response_mask      bool     optional; False tokens count in no loss and no metric
                                (default: every token counts)
    rollout_log_probs  float    optional; the sampler's (vLLM's) log-probs. With
                                rollout.tis_cap set, update_actor needs it and weights each
                                token's policy loss by min(exp(old - rollout), tis_cap)
    seq_is_weights     float    optional; the driver's sequence-level rollout correction
                                (rollout.seq_tis_cap): one weight per response on its tokens

One PPO step, from the driver (each call reads the fields listed above and takes its plan,
`plan=plans.forward(role)` or `plans.update(role)`, see rlhf/trainer/step_splits.py):
    batch |= rm.compute_rm_score(batch)           if reward.model_path (rm_scores)
    batch |= actor.compute_log_prob(batch)        old_log_probs, entropy (unless fused)
    batch |= ref.compute_ref_log_prob(batch)      if algorithm.use_ref
    batch |= critic.compute_values(batch)         if the estimator takes values (gae)
    advantages, returns: on the driver (KL penalty, estimator)
    critic.update_critic(batch); actor.update_actor(batch)   -> {"critic/...": x}, {"actor/...": x}
    (fused: actor.update_actor -> ({"actor/...": x}, Batch of old_log_probs, entropy))
(`|=` standing for `batch = batch.union(...)`). Updates step once per mini-batch of the plan:
<role>.ppo_mini_batch_size prompts (x rollout.n samples), consecutive in the driver's order
whatever the DP size: shuffle on the driver if wanted, and send a multiple of that many.
"""

from __future__ import annotations

from collections.abc import Sequence

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

TOKENS = ("prompt_ids", "response_ids")
"""What every role call reads: the packed prompt + response of each sample."""


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


def require_fields(batch: Batch, names: Sequence[str], where: str) -> None:
    """ValueError naming what `where` needs when the batch lacks some of `names`."""
    missing = [n for n in names if n not in batch]
    if missing:
        raise ValueError(f"{where} needs batch fields {missing}, which the batch lacks "
                         f"(it has {batch.keys()}); see rlhf/data/fields.py for who makes them")
