"""Rollout: vLLM engines inside the actor's ranks, weight sync from the trainer, and the
check that both agree on the log-probs of sampled tokens."""

from rlhf.rollout.engine import Completion, RolloutEngine, engine_args, engine_environment
from rlhf.rollout.replica import ReplicaSpec, RolloutReplica
from rlhf.rollout.sampling import (derive_seed, logprob_gap, request_seeds, sampling_params,
                                   sampling_temperature)

__all__ = ["Completion", "ReplicaSpec", "RolloutEngine", "RolloutReplica",
           "derive_seed", "engine_args", "engine_environment", "logprob_gap", "request_seeds",
           "sampling_params", "sampling_temperature"]
