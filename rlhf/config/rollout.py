"""The `rollout` section: how each replica samples responses (vLLM settings, stop rules,
rollout correction, multi-turn budgets and the environment, where the rollout ranks live)."""

from dataclasses import dataclass, field
from typing import Literal

from rlhf.config.envs import EnvConfig
from rlhf.config.rules import require_min, require_placement, require_range
from rlhf.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Response sampling with the in-process vLLM engine of each actor rollout replica."""

    tp: int = 1
    """Tensor-parallel size of one vLLM replica; divides the actor's world size."""
    n: int = 1
    """Responses sampled per prompt (the group size of grpo/rloo)."""
    temperature: float = 1.0
    """Sampling temperature in [0, 2] (vLLM's range); 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 = off."""
    max_new_tokens: int = 512
    """Longest response, in tokens."""
    stop: tuple[str, ...] = ()
    """Extra stop strings (the tokenizer's EOS always stops)."""
    seed: int = 0
    """Sampling seed."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (weights + KV cache), on CUDA."""
    cpu_kv_cache_gb: float = 1.0
    """KV-cache size in GiB per replica, on CPU."""
    max_num_seqs: int = 256
    """Most sequences vLLM decodes at once."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower decoding, faster start, less memory)."""
    sync_bucket_mb: float = 256.0
    """Weight sync moves full tensors in buckets of about this many MiB (peak extra memory)."""
    max_logprob_gap: float | None = 1.0
    """Stop the job when, after a weight sync, the largest |log-prob| difference between vLLM's
    sampled tokens and the trainer's exceeds this (a broken or half-synced engine); null = off.
    A healthy gap comes from kernels and dtype only: about 1e-5 in float32 and 0.1 in bfloat16
    on the quickstart's model, while a layer whose weights did not arrive gives nats."""
    tis_cap: float | None = None
    """Truncated importance sampling: weight tokens by min(pi_train / pi_vllm, cap); null = off."""
    seq_tis_cap: float | None = None
    """Sequence-level TIS: weight a response's tokens by min(pi_train(y) / pi_vllm(y), cap)."""
    reject_band: tuple[float, float] | None = None
    """[low, high]: mask responses whose per-token geometric-mean pi_train / pi_vllm leaves it."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: a vLLM replica on every actor rank, synced in-process; separate: world_size
    rollout ranks of their own (no training engine), sent weights over a transfer group."""
    world_size: int | None = None
    """Ranks of the separate rollout pool (a multiple of tp); set exactly when separate."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts: the environment that answers each model turn (rlhf/envs)."""
    max_turns: int = 1
    """Most model turns per episode when rollout.env is set (max_new_tokens is per turn)."""
    max_episode_tokens: int | None = None
    """Most response tokens of an episode (model + environment); null = max_turns x max_new_tokens."""

    @property
    def max_response_tokens(self) -> int:
        """Longest response a rollout returns: a whole episode with an environment."""
        if self.env.path is None:
            return self.max_new_tokens
        if self.max_episode_tokens is None:
            return self.max_turns * self.max_new_tokens
        return self.max_episode_tokens

    def __post_init__(self):
        require_min(self, 1, "tp", "n", "max_new_tokens", "max_num_seqs")
        if self.sync_bucket_mb <= 0:
            raise ConfigError("rollout.sync_bucket_mb must be positive, got "
                              f"{self.sync_bucket_mb}")
        require_range(self, "temperature", 0, 2)
        require_range(self, "top_p", 0, 1, low_open=True)
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"top_k must be -1 (off) or at least 1, got {self.top_k}")
        require_range(self, "gpu_memory_utilization", 0, 1, low_open=True)
        if self.cpu_kv_cache_gb <= 0:
            raise ConfigError(f"cpu_kv_cache_gb must be positive, got {self.cpu_kv_cache_gb}")
        if self.max_logprob_gap is not None and self.max_logprob_gap <= 0:
            raise ConfigError(f"max_logprob_gap must be positive or null, got "
                              f"{self.max_logprob_gap}")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ConfigError(f"tis_cap must be at least 1 (a cap below 1 down-weights every "
                              f"token) or null, got {self.tis_cap}")
        if self.seq_tis_cap is not None and self.seq_tis_cap < 1:
            raise ConfigError(f"seq_tis_cap must be at least 1 (a cap below 1 down-weights every "
                              f"response) or null, got {self.seq_tis_cap}")
        band = self.reject_band
        if band is not None and not 0 < band[0] <= 1 <= band[1]:
            raise ConfigError(f"reject_band must be [low, high] with 0 < low <= 1 <= high (a "
                              f"ratio of 1 means sampler and trainer agree), got {list(band)}")
        if "" in self.stop:
            raise ConfigError("stop must not contain an empty string")
        require_min(self, 1, "max_turns")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise ConfigError(f"max_episode_tokens must be at least 1 or null, got "
                              f"{self.max_episode_tokens}")
        if self.env.path is not None and self.tp != 1:
            raise ConfigError(f"env: multi-turn rollouts run on replicas of one rank; set "
                              f"rollout.tp=1 (got {self.tp})")
        require_placement(self)
