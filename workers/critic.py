"""CriticWorker: the value model's TrainEngine (used exactly when algorithm.adv_estimator is gae).

`values` of response token j is the value head at the position that predicts token j, i.e. the
value of the state prompt + response[:j]. The loss is `value_loss` (clipped to old value +-
algorithm.value_clip), aggregated by algorithm.loss_agg_mode over global counts like the actor's.
"""

from __future__ import annotations

from torch import Tensor

from rlhf.algorithms import aggregate, estimator_needs, value_loss
from rlhf.config import JobConfig
from rlhf.controller import Dispatch, WorkerContext, register
from rlhf.data.batch import Batch
from rlhf.data.batch_split import GroupBatches
from rlhf.data.fields import MASK, TOKENS, require_fields
from rlhf.engine.offload import Offloader, in_phase
from rlhf.errors import ConfigError
from workers.base import MemoryReportMixin, Worker, build_engine
from workers.checkpoint import CheckpointMixin
from workers.micro_batches import forward_micro_batches, response_fields
from workers.updates import ppo_updates, token_share


class CriticWorker(CheckpointMixin, MemoryReportMixin, Worker):
    """The value model on its own (config.critic.parallel) layout: values and value updates.

    Loads critic.model_path, or model.path with a value head drawn from trainer.seed.
    """

    def __init__(self, ctx: WorkerContext, *, config: JobConfig):
        super().__init__(ctx)
        if not estimator_needs(config.algorithm.adv_estimator).critic:
            raise ConfigError(f"critic: algorithm.adv_estimator={config.algorithm.adv_estimator} "
                              "takes no values, so no critic is trained; do not create a "
                              "CriticWorker, or use an estimator that takes values_T (gae)")
        self.config = config
        self.engine = build_engine(self, config, "critic",
                                   path=config.critic.model_path or config.model.path,
                                   head="value", train=True)
        self.offload = Offloader(self.engine.state_tensors, config=config.critic.offload)

    @register(dispatch=Dispatch.DP_COMPUTE)
    @in_phase("forward")
    def compute_values(self, batch: Batch, split: GroupBatches | None = None) -> Batch:
        """`values` of every response token (see the module docstring)."""
        require_fields(batch, TOKENS, "critic.compute_values")
        mbs = forward_micro_batches(batch, self.config.critic, split, key="critic")
        outputs = self.engine.forward(mbs, outputs=("values",))
        return response_fields(outputs, mbs, {"values": "values"})

    @register(dispatch=Dispatch.DP_COMPUTE_METRICS)
    @in_phase("update")
    def update_critic(self, batch: Batch, split: GroupBatches | None = None) -> dict[str, float]:
        """algorithm.ppo_epochs passes, one step per critic.ppo_mini_batch_size prompts' samples;
        needs `values` (from compute_values, before any update) and `returns`."""
        per_token = ("values", "returns")
        require_fields(batch, (*TOKENS, *per_token), "critic.update_critic")
        return ppo_updates(self.engine, batch, split, self.config, "critic", per_token,
                           self._loss_fn, outputs=("values",))

    def _loss_fn(self, global_tokens: int, global_seqs: int):
        algo = self.config.algorithm
        norm = dict(agg_mode=algo.loss_agg_mode, global_tokens=global_tokens,
                    global_seqs=global_seqs, max_response_length=self.config.rollout.max_response_tokens)

        def loss_fn(out: dict[str, Tensor], mb) -> tuple[Tensor, dict]:
            t, cu = mb.tensors, mb.packed.cu_seqlens
            mask_T = t[MASK].bool()
            loss, metrics = value_loss(out["values"], t["values"], t["returns"], mask_T, cu,
                                       clip=algo.value_clip, **norm)
            return loss, {
                "value_loss": loss.detach(),
                "clipfrac": metrics["clipfrac"] * token_share(mask_T, global_tokens),
                "values_mean": aggregate(out["values"].detach(), mask_T, cu, "token-mean",
                                         global_tokens=global_tokens),
            }

        return loss_fn
