"""ReferenceWorker: the frozen initial policy (model.path), forward only, no optimizer state.

With actor.lora on, no ReferenceWorker is built: the actor runs `ref_log_probs` on its own
model with the adapters disabled (`rlhf.config.ref_from_actor`)."""

from __future__ import annotations

from rlhf.config import JobConfig
from rlhf.controller import Dispatch, WorkerContext, register
from rlhf.data.batch import Batch
from rlhf.data.batch_split import GroupBatches
from rlhf.data.fields import TOKENS, require_fields
from rlhf.engine import TrainEngine
from rlhf.engine.offload import Offloader, in_phase
from rlhf.errors import ConfigError
from rlhf.rollout import sampling_temperature
from rlhf.rollout.routing import replays_routes
from workers.base import MemoryReportMixin, Worker, build_engine
from workers.micro_batches import forward_micro_batches, response_fields


class ReferenceWorker(MemoryReportMixin, Worker):
    """The reference policy on its own (config.ref.parallel) layout."""

    def __init__(self, ctx: WorkerContext, *, config: JobConfig):
        super().__init__(ctx)
        if not config.algorithm.use_ref:
            raise ConfigError("ref: algorithm.use_kl_loss and algorithm.kl_in_reward are both "
                              "false, so no KL term needs reference log-probs; do not create a "
                              "ReferenceWorker, or turn one of them on")
        self.config = config
        self.engine = build_engine(self, config, "ref", path=config.model.path, head="lm",
                                   train=False)
        self.offload = Offloader(self.engine.state_tensors, config=config.ref.offload)

    @register(dispatch=Dispatch.DP_COMPUTE)
    @in_phase("forward")
    def compute_ref_log_prob(self, batch: Batch, split: GroupBatches | None = None) -> Batch:
        """`ref_log_probs` of every response token, at the sampling temperature like the actor's;
        an MoE reference replays the batch's `routed_experts` with rollout.routing_replay on."""
        return ref_log_probs(self.engine, batch, split, self.config, key="ref")


def ref_log_probs(engine: TrainEngine, batch: Batch, split: GroupBatches | None,
                  config: JobConfig, *, key: str) -> Batch:
    """`ref_log_probs` from `engine`, micro-batched by config.<key>: the reference role's model,
    or the actor's with its adapters disabled (`rlhf.config.ref_from_actor`)."""
    require_fields(batch, TOKENS, f"{key}.compute_ref_log_prob")
    mbs = forward_micro_batches(batch, getattr(config, key), split, key=key,
                                replay_routes=replays_routes(config.rollout))
    outputs = engine.forward(mbs, outputs=("log_probs",),
                             temperature=sampling_temperature(config.rollout))
    return response_fields(outputs, mbs, {"ref_log_probs": "log_probs"})
