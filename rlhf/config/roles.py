"""Per-role sections (parallel plan, optimizer, trainable and forward-only roles, rewards), and
`job_roles`: which roles a job creates."""

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rlhf.config.rollout import RolloutConfig
from rlhf.config.rules import (require_min, require_placement, require_positive_or_none,
                               require_range)
from rlhf.errors import ConfigError

if TYPE_CHECKING:
    from rlhf.config.schema import JobConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]

# "pkg.module:function" or "path/to/file.py:function"
_MODULE_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How one role's model is split over its ranks; data parallelism takes the remaining ranks."""

    tp: int = 1
    """Tensor-parallel size (Megatron-style column/row split of every layer)."""
    pp: int = 1
    """Pipeline-parallel size (number of pipeline stages)."""
    vpp: int = 1
    """Virtual stages per pipeline rank (interleaved 1F1B when > 1; needs pp > 1)."""
    sequence_parallel: bool = False
    """Shard activations outside attention/MLP along the token axis (needs tp > 1)."""
    layers_per_stage: tuple[int, ...] | None = None
    """Uneven layer split, one entry per virtual stage (pp * vpp entries); null = even split."""

    def __post_init__(self):
        require_min(self, 1, "tp", "pp", "vpp")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError(f"vpp={self.vpp} needs pp > 1 (interleaving splits pipeline stages); "
                              "set vpp to 1 or raise pp")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel needs tp > 1; set it to false or raise tp")
        if self.layers_per_stage is not None:
            stages = self.pp * self.vpp
            if len(self.layers_per_stage) != stages:
                raise ConfigError(
                    f"layers_per_stage has {len(self.layers_per_stage)} entries but pp * vpp = "
                    f"{stages}; give one layer count per virtual stage")
            if min(self.layers_per_stage) < 1:
                raise ConfigError(f"layers_per_stage entries must be at least 1, got "
                                  f"{list(self.layers_per_stage)}")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with warmup and a decay schedule."""

    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1 and beta2, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to lr; must be below trainer.total_steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after warmup."""
    min_lr_ratio: float = 0.0
    """Final learning rate of linear/cosine decay, as a fraction of lr."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; null = no clipping."""
    distributed: bool | None = None
    """ZeRO-1: shard fp32 masters and Adam moments over the role's DP ranks; null = on if dp > 1."""

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        for beta in self.betas:
            if not 0 <= beta < 1:
                raise ConfigError(f"betas must each be in [0, 1), got {list(self.betas)}")
        if self.eps <= 0:
            raise ConfigError(f"eps must be positive, got {self.eps}")
        require_min(self, 0, "weight_decay", "warmup_steps")
        require_range(self, "min_lr_ratio", 0, 1)
        require_positive_or_none(self, "grad_clip")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Training state a colocated role keeps in host memory while it is not computing (vLLM
    generates, another role runs); each kind comes back to the device when a phase needs it."""

    params: bool = False
    """Weights on the host except during this role's forward passes, updates and weight syncs."""
    grads: bool = False
    """Gradients on the host outside the updates."""
    optimizer: bool = False
    """fp32 master weights and AdamW moments on the host outside the updates."""


@dataclass(frozen=True, kw_only=True)
class ForwardRoleConfig:
    """A role that only runs forward passes (reference policy, reward model)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/pipeline plan of this role."""
    dtype: Dtype = "auto"
    """Parameter and compute dtype; auto = bfloat16 on CUDA, float32 on CPU."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget of one packed micro-batch; one whole sequence must fit."""
    share_prompts: bool = True
    """Samples of one prompt in the same micro-batch hold its tokens once (same outputs; fewer
    tokens to compute when rollout.n > 1)."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: share the trainer's pool of ranks; separate: a pool of world_size ranks."""
    world_size: int | None = None
    """Ranks of this role's own pool; set exactly when placement is separate."""

    def __post_init__(self):
        require_min(self, 1, "max_tokens_per_micro_batch")
        require_placement(self)


@dataclass(frozen=True, kw_only=True)
class TrainRoleConfig(ForwardRoleConfig):
    """A role whose model is trained (the actor; the critic adds its own fields)."""

    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    recompute: Literal["none", "attention_block", "full"] = "none"
    """Activation recomputation: none, attention_block (each layer's attention block) or full
    (whole layers)."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step (each brings rollout.n samples); divides data.train_batch_size."""
    micro_batch_size: int | None = None
    """Optional cap on samples per micro-batch, on top of the token budget; null = tokens only."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """What this role moves to host memory around rollouts (see rlhf/engine/offload.py)."""

    def __post_init__(self):
        super().__post_init__()
        require_min(self, 1, "ppo_mini_batch_size")
        if self.micro_batch_size is not None:
            require_min(self, 1, "micro_batch_size")


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig(ForwardRoleConfig):
    """The frozen reference policy: forward only, so only its weights can move to the host."""

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Weights to host memory around rollouts (params only: the role has no grads or optimizer)."""

    def __post_init__(self):
        super().__post_init__()
        for kind in ("grads", "optimizer"):
            if getattr(self.offload, kind):
                raise ConfigError(f"offload.{kind}: the reference is forward only and has no "
                                  f"{kind} to move; set it to false (offload.params moves its "
                                  "weights)")


@dataclass(frozen=True, kw_only=True)
class CriticConfig(TrainRoleConfig):
    """The value model; used exactly when algorithm.adv_estimator is gae."""

    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """Optimizer and learning-rate schedule."""
    model_path: str | None = None
    """Initial critic weights (HF folder); null = model.path with a freshly initialised head."""

    def __post_init__(self):
        super().__post_init__()
        if self.model_path == "":
            raise ConfigError("model_path must not be empty; use null for model.path")


@dataclass(frozen=True, kw_only=True)
class RewardFunctionConfig:
    """One rule-based reward function and its weight in the total reward."""

    path: str
    """'package.module:function' or 'path/to/file.py:function'."""
    weight: float = 1.0
    """Multiplier of this function's score in the summed reward."""

    def __post_init__(self):
        target, sep, function = self.path.rpartition(":")
        module_ok = target.endswith(".py") or _MODULE_TARGET.fullmatch(target)
        if not (sep and module_ok and _IDENTIFIER.fullmatch(function)):
            raise ConfigError(f"path must look like 'package.module:function' or "
                              f"'path/to/file.py:function', got {self.path!r}")


@dataclass(frozen=True, kw_only=True)
class RewardConfig(ForwardRoleConfig):
    """Reward functions and an optional reward model; the role fields plan the reward model."""

    functions: tuple[RewardFunctionConfig, ...] = ()
    """Rule-based reward functions; their weighted scores are summed."""
    model_path: str | None = None
    """HF folder of a sequence-scoring reward model; null = no reward model."""
    model_weight: float = 1.0
    """Multiplier of the reward model's score in the summed reward."""
    timeout_s: float = 10.0
    """Seconds one reward-function call may take before it counts as an error."""
    import_timeout_s: float = 60.0
    """Seconds the import check of the reward functions (run before the job starts) may take."""
    num_workers: int = 2
    """Reward worker processes; 0 = run them in the calling process, without timeouts (debug)."""
    on_error: Literal["raise", "fallback"] = "raise"
    """On an exception or timeout: raise (stop training) or score fallback_score."""
    fallback_score: float = 0.0
    """Score given to a response whose reward function failed, when on_error is fallback."""

    def __post_init__(self):
        super().__post_init__()
        paths = [fn.path for fn in self.functions]
        for path in paths:
            if paths.count(path) > 1:
                raise ConfigError(f"functions lists {path!r} twice; merge the entries' weights")
        for key in ("timeout_s", "import_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be positive, got {getattr(self, key)}")
        require_min(self, 0, "num_workers")


TRAINED_ROLES = ("actor", "critic")  # the roles with an optimizer, whose state a checkpoint holds


def job_roles(cfg: "JobConfig") -> dict[str, "ForwardRoleConfig | RolloutConfig"]:
    """The roles a PPO job creates, in build order, each with its config section: the actor;
    the critic when algorithm.use_critic; the reference when algorithm.use_ref; the reward
    model when reward.model_path is set; the rollout pool when rollout.placement is separate."""
    roles: dict[str, ForwardRoleConfig | RolloutConfig] = {"actor": cfg.actor}
    if cfg.algorithm.use_critic:
        roles["critic"] = cfg.critic
    if cfg.algorithm.use_ref:
        roles["ref"] = cfg.ref
    if cfg.reward.model_path is not None:
        roles["reward"] = cfg.reward
    if cfg.rollout.placement == "separate":
        roles["rollout"] = cfg.rollout
    return roles
