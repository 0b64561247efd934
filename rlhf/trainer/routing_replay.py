"""The driver's figures of MoE routing replay (rollout.routing_replay; rlhf.rollout.routing).

Each costs the actor one forward pass more per step, without grad, over the step's batch:
- rollout: before the update, a pass that routes freely. routing/token_match is the share of
  positions whose experts the trainer chose as vLLM did (in every layer), routing/layer_match
  the share of (position, layer) pairs; routing/logprob_gap_free_* is the sampler-trainer
  log-prob gap without replay, beside rollout/logprob_gap_* with it.
- trainer: after the update, a pass of the updated policy that routes freely: the same match
  shares against the routes the old-log-prob pass recorded and the update replayed, i.e. the
  positions whose routing the update left unchanged.
"""

from __future__ import annotations

from rlhf.config import RolloutConfig
from rlhf.controller import RoleView
from rlhf.data.batch import Batch
from rlhf.data.batch_split import BatchSplit
from rlhf.data.fields import response_mask
from rlhf.data.routes import ROUTES, routing_agreement
from rlhf.rollout.routing import records_in_rollout
from rlhf.rollout.sampling import logprob_gap


def before_update(actor: RoleView, batch: Batch, split: BatchSplit,
                  config: RolloutConfig) -> dict[str, float]:
    """With routes from vLLM: agreement and the log-prob gap of a free pass (see above)."""
    if not records_in_rollout(config) or ROUTES not in batch:
        return {}
    free = _free_pass(actor, batch, split)
    metrics = _agreement(batch[ROUTES], free[ROUTES])
    if "rollout_log_probs" in batch:
        gap = logprob_gap(free["old_log_probs"], batch["rollout_log_probs"],
                          mask=response_mask(batch))
        metrics.update({k.replace("rollout/logprob_gap", "routing/logprob_gap_free"): v
                        for k, v in gap.items()})
    return metrics


def after_update(actor: RoleView, batch: Batch, split: BatchSplit,
                 config: RolloutConfig) -> dict[str, float]:
    """With routes the trainer recorded: how many the updated policy still chooses."""
    if config.routing_replay != "trainer" or ROUTES not in batch:
        return {}
    return _agreement(batch[ROUTES], _free_pass(actor, batch, split)[ROUTES])


def _free_pass(actor: RoleView, batch: Batch, split: BatchSplit) -> Batch:
    _, rest = batch.pop(ROUTES)
    return actor.compute_log_prob(rest, split=split)  # no routes in: it records them


def _agreement(recorded, chosen) -> dict[str, float]:
    got = routing_agreement(recorded, chosen)
    return {"routing/token_match": got["token_match"], "routing/layer_match": got["layer_match"]}
