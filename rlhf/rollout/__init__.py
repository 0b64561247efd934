"""Rollout: vLLM engines inside the actor's ranks, weight sync from the trainer, and the
check that both agree on the log-probs of sampled tokens."""

from rlhf.rollout.replica import ReplicaSpec, RolloutReplica
from rlhf.rollout.sampling import (
                                   derive_seed,
                                   logprob_gap,
                                   request_seeds,
                                   sampling_params,
                                   sampling_temperature,
)
from rlhf.rollout.vllm_sampler import Completion, VllmSampler, vllm_args, vllm_environment

__all__ = ["Completion", "ReplicaSpec", "VllmSampler", "RolloutReplica",
           "derive_seed", "vllm_args", "vllm_environment", "logprob_gap", "request_seeds",
           "sampling_params", "sampling_temperature"]
