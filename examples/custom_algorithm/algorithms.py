"""An advantage estimator and a KL estimator of your own, named in a job config by path.

    algorithm:
      adv_estimator: examples/custom_algorithm/algorithms.py:best_of_group
      kl_loss_type: examples/custom_algorithm/algorithms.py:squared_log_ratio

See docs/guides/algorithms.md ("Your own entries") for the arguments each kind receives.
"""

import torch
from torch import Tensor


@torch.no_grad()
def best_of_group(scores_N: Tensor, group_ids: Tensor, cu_seqlens: Tensor,
                  mask_T: Tensor | None) -> tuple[Tensor, Tensor]:
    """+1 on every token of each prompt's best response, -1 / (n - 1) on the others' (a
    zero-mean group baseline). Taking `group_ids` makes it a group estimator (rollout.n >= 2);
    it takes no `values_T`, so no critic is built."""
    adv_N = torch.empty_like(scores_N)
    for g in group_ids.unique():
        rows = (group_ids == g).nonzero().flatten()
        adv_N[rows] = -1.0 / max(len(rows) - 1, 1)
        adv_N[rows[scores_N[rows].argmax()]] = 1.0
    adv_T = adv_N.repeat_interleave(cu_seqlens.diff())
    if mask_T is not None:
        adv_T = adv_T * mask_T
    return adv_T, adv_T.clone()


def squared_log_ratio(logp_T: Tensor, ref_logp_T: Tensor) -> Tensor:
    """Per-token KL estimate 0.5 (log pi - log ref)^2 (the built-in k2, written out)."""
    return 0.5 * (logp_T - ref_logp_T).square()
