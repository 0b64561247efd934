"""Rollout: vLLM engines inside the actor's ranks, weight sync from the trainer, and the
check that both agree on the log-probs of sampled tokens."""

from rlhf.rollout.engine import Completion, RolloutEngine, engine_args
from rlhf.rollout.process import configure_engine_process
from rlhf.rollout.replica import ReplicaSpec, RolloutReplica
from rlhf.rollout.sampling import derive_seed, logprob_gap, request_seeds, sampling_params

__all__ = ["Completion", "ReplicaSpec", "RolloutEngine", "RolloutReplica",
           "configure_engine_process", "derive_seed", "engine_args", "logprob_gap",
           "request_seeds", "sampling_params"]
