"""RL algorithms as pure tensor functions: advantage estimators, KL terms, policy/value losses.

Data layout (the contract with the trainer)
-------------------------------------------
Only RESPONSE tokens appear, packed: n samples back to back in one stream of T tokens, never
padded to a rectangle.

- `x_T` (T,): one value per response token (rewards, values, log-probs, losses, ...).
  Sample i owns `x_T[cu_seqlens[i]:cu_seqlens[i + 1]]`, in generation order.
- `cu_seqlens` (n+1,) int32 or int64: cu_seqlens[0] == 0, non-decreasing, cu_seqlens[-1] == T.
  An empty response is a repeated entry; it keeps its slot, so row i is always sample i.
- `mask_T` (T,) bool or 0/1 float, True = the token counts. Masked tokens (after a truncation,
  tool output, ...) are skipped: as if absent in the GAE and returns-to-go recursions, left out
  of every mean and whitening, 0 in every returned per-token tensor. They may hold any value,
  NaN included: it never reaches a loss or a gradient. `mask_T=None` means all tokens count.
- `scores_N` (n,): one scalar per sample (the sequence reward).
- `group_ids` (n,) int: samples of the same prompt share an id (GRPO, RLOO, REINFORCE++
  baseline); ids are arbitrary integers and a group's samples need not be contiguous.

Advantages run on the driver (no autograd); losses run per micro-batch and are differentiable
in `logp_T` / `values_T`. Per-token log-probs here are those of the response token itself
(`rlhf.data.packing.response_values(..., next_token=True)` gives them from a packed forward).
"""

from rlhf.algorithms.advantages import (
                                        compute_advantage,
                                        gae,
                                        get_advantage,
                                        grpo,
                                        masked_whiten,
                                        register_advantage,
                                        reinforce_plus_plus,
                                        reinforce_plus_plus_baseline,
                                        rloo,
                                        scores_to_token_rewards,
                                        sequence_scores,
)
from rlhf.algorithms.kl import (
                                        AdaptiveKLController,
                                        FixedKLController,
                                        KLController,
                                        apply_kl_penalty,
                                        build_kl_controller,
                                        get_kl,
                                        get_kl_controller,
                                        kl,
                                        register_kl,
                                        register_kl_controller,
)
from rlhf.algorithms.losses import (
                                        aggregate,
                                        entropy_bonus,
                                        get_loss_agg,
                                        kl_loss,
                                        loss_normalizers,
                                        ppo_policy_loss,
                                        register_loss_agg,
                                        truncated_is_weights,
                                        value_loss,
)
from rlhf.algorithms.needs import algorithm_needs, estimator_needs
from rlhf.algorithms.policy_losses import (
                                        cispo_policy_loss,
                                        get_policy_loss,
                                        gspo_policy_loss,
                                        policy_clip,
                                        register_policy_loss,
)

__all__ = [
    "AdaptiveKLController", "FixedKLController", "KLController", "aggregate", "algorithm_needs",
    "apply_kl_penalty", "build_kl_controller", "cispo_policy_loss", "compute_advantage",
    "entropy_bonus", "estimator_needs", "gae", "get_advantage", "get_kl", "get_kl_controller", "get_loss_agg",
    "get_policy_loss", "grpo", "gspo_policy_loss", "kl", "kl_loss", "loss_normalizers",
    "masked_whiten", "policy_clip", "ppo_policy_loss", "register_advantage", "register_kl",
    "register_kl_controller", "register_loss_agg", "register_policy_loss", "reinforce_plus_plus",
    "reinforce_plus_plus_baseline", "rloo", "scores_to_token_rewards", "sequence_scores",
    "truncated_is_weights", "value_loss",
]
