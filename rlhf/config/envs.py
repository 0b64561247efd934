"""The `rollout.env` section: the environment of multi-turn rollouts (rlhf/envs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rlhf.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """An environment that answers every model turn (rlhf.envs.Env); null path = single turn."""

    path: str | None = None
    """'package.module:Class' or 'path/to/file.py:Class' (an rlhf.envs.Env); null = no environment."""
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)  # keeps configs hashable
    """Keyword arguments of the environment's constructor."""
    num_workers: int = 2
    """Environment worker processes per rollout rank; 0 = in the rank's process, no time limit."""
    timeout_s: float = 30.0
    """Seconds one environment call (reset or step) may take before it counts as an error."""
    on_error: Literal["raise", "fallback"] = "raise"
    """On an environment error or timeout: raise (stop training) or end the episode with fallback_reward."""
    fallback_reward: float = 0.0
    """Reward of an episode whose environment failed, when on_error is fallback."""

    def __post_init__(self):
        if self.path is not None and ":" not in self.path:
            raise ConfigError(f"path must look like 'package.module:Class' or "
                              f"'path/to/file.py:Class', got {self.path!r}")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers must be at least 0, got {self.num_workers}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s}")
