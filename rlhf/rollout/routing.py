"""Where the routes of MoE routing replay come from (rollout.routing_replay), and vLLM's routes
as a Batch field (rlhf.data.routes).

rollout: vLLM records the experts it routed every position of a sample to and returns them with
the sample (`enable_return_routed_experts`); it does so only with its V2 model runner, which
needs Triton, so only on CUDA. trainer: the actor's old-log-prob forward records the experts it
chose and its later forwards of the batch (the update, the reference) replay them: the
fallback on the CPU, where it exercises the same replay path; it removes the drift between the
trainer's passes of one batch (the update's weights move between mini-batches), not the one
between vLLM and the trainer.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from rlhf.config import RolloutConfig
from rlhf.data.routes import FREE
from rlhf.errors import ConfigError


def check_routing_source(config: RolloutConfig, *, on_cuda: bool) -> None:
    """ConfigError when rollout.routing_replay asks vLLM for routes it cannot return here."""
    if config.routing_replay == "rollout" and not on_cuda:
        raise ConfigError(
            "rollout.routing_replay=rollout needs vLLM to return routed experts, which only its "
            "V2 model runner does, and that needs Triton: not on the CPU build. Use "
            "rollout.routing_replay=trainer (the old-log-prob forward records the routes the "
            "later forwards replay) or off")


def check_replay_model(config: RolloutConfig, *, is_moe: bool) -> None:
    """ConfigError when routing replay is on for a policy without experts to route to."""
    if replays_routes(config) and not is_moe:
        raise ConfigError(f"rollout.routing_replay={config.routing_replay} replays the experts "
                          "of a mixture-of-experts policy, but the policy is dense; set "
                          "rollout.routing_replay=off")


def replays_routes(config: RolloutConfig) -> bool:
    """The trainer's forwards of a batch replay its routes (rollout.routing_replay not off)."""
    return config.routing_replay != "off"


def records_in_rollout(config: RolloutConfig) -> bool:
    """vLLM returns each sample's routes (rollout.routing_replay=rollout)."""
    return config.routing_replay == "rollout"


def sample_routes(routed: np.ndarray | None, *, positions: int) -> Tensor | None:
    """vLLM's (positions seen, num_layers, top_k) routes of one sample as `positions` rows
    (prompt + response) of int16; the last sampled token, never fed back, reads FREE."""
    if routed is None:
        return None
    routes = torch.as_tensor(np.asarray(routed), dtype=torch.int16)
    if routes.dim() != 3 or routes.shape[0] > positions:
        raise RuntimeError(f"vLLM returned routes of shape {tuple(routes.shape)} for a sample "
                           f"of {positions} positions; expected (<= {positions}, layers, top_k)")
    out = routes.new_full((positions, *routes.shape[1:]), FREE)
    out[:routes.shape[0]] = routes
    return out
