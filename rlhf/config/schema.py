"""The job configuration: one frozen `JobConfig` made of per-section dataclasses.

Defaults live here and only here. Relative paths are relative to the working directory.
Checks that involve one section run in `__post_init__`; checks across sections (and against
the model's config.json) are in `rlhf.config.checks`.
"""

from dataclasses import dataclass, field
from typing import Literal

from rlhf.config.roles import (CriticConfig, ForwardRoleConfig, ReferenceConfig, RewardConfig,
                               TrainRoleConfig)
from rlhf.config.rules import require_min, require_positive_or_none, require_range
from rlhf.config.rollout import RolloutConfig
from rlhf.config.sft import SFTConfig
from rlhf.config.tiny import TinyModelConfig
from rlhf.errors import ConfigError

AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
KLEstimator = Literal["k1", "k2", "k3", "abs"]
# Estimators that compare the rollout.n responses of one prompt with each other.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The initial policy (also the reference policy, and the critic's trunk by default)."""

    path: str = "outputs/model"
    """Hugging Face model folder (config.json, safetensors, tokenizer)."""
    tokenizer_path: str | None = None
    """Tokenizer folder; null = the model folder."""
    tiny: TinyModelConfig | None = None
    """Build a tiny random-init model at path when the folder is missing; null = never build."""


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """Advantage estimation, KL regularisation and the clipped policy/value losses."""

    adv_estimator: AdvEstimator = "gae"
    """gae trains a critic; grpo, rloo and reinforce_plus_plus_baseline compare responses."""
    gamma: float = 1.0
    """Discount factor of GAE and REINFORCE++ returns."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group std (false = Dr. GRPO)."""
    kl_in_reward: bool = False
    """Subtract kl_coef * KL(policy || ref) from the token rewards."""
    kl_penalty: KLEstimator = "k1"
    """KL estimator of the in-reward penalty."""
    kl_coef: float = 0.001
    """Coefficient of the in-reward KL penalty (initial value when kl_ctrl is adaptive)."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """Keep kl_coef fixed, or adapt it to reach kl_target."""
    kl_target: float | None = None
    """Target KL per sequence of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon (in samples) of the adaptive controller."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || ref) to the actor loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: KLEstimator = "k3"
    """KL estimator of the KL loss."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is kept above 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: the ratio is kept below 1 + clip_ratio_high (clip-higher); cispo's cap too."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound on the loss of negative-advantage tokens; must exceed 1."""
    value_clip: float | None = 0.5
    """Clip value predictions to old value +- value_clip; null = no clipping."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient in the actor loss."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses are reduced to one number."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """Policy loss: ppo (token ratio), gspo (sequence ratio), cispo (clipped IS weight)."""
    gspo_clip_low: float = 3e-4
    """GSPO: the sequence ratio is kept above 1 - gspo_clip_low."""
    gspo_clip_high: float = 4e-4
    """GSPO: the sequence ratio is kept below 1 + gspo_clip_high."""
    overlong_buffer: int = 0
    """Soft overlong penalty over the last this-many tokens before max_new_tokens; 0 = off."""
    overlong_penalty: float = 1.0
    """Score penalty at max_new_tokens, reached linearly across overlong_buffer."""
    mask_truncated: bool = False
    """Leave responses cut at max_new_tokens (no EOS) out of the loss."""
    dynamic_sampling: Literal["off", "all_equal", "std_below"] = "off"
    """Drop prompt groups without reward spread and refill the batch with fresh prompts."""
    dynamic_sampling_std: float = 0.0
    """std_below: drop groups whose reward std is below this (must be positive)."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: most generate-and-score rounds per step (round 1 included)."""

    def __post_init__(self):
        require_range(self, "gamma", 0, 1)
        require_range(self, "lam", 0, 1)
        require_min(self, 0, "kl_coef", "kl_loss_coef", "entropy_coeff")
        require_min(self, 1, "kl_horizon", "ppo_epochs")
        require_range(self, "clip_ratio_low", 0, 1, low_open=True, high_open=True)
        if self.clip_ratio_high <= 0:
            raise ConfigError(f"clip_ratio_high must be positive, got {self.clip_ratio_high}")
        if self.clip_ratio_c <= 1:
            raise ConfigError(f"clip_ratio_c must be greater than 1, got {self.clip_ratio_c}")
        require_positive_or_none(self, "value_clip")
        require_range(self, "gspo_clip_low", 0, 1, low_open=True, high_open=True)
        require_min(self, 0, "overlong_buffer", "overlong_penalty", "dynamic_sampling_std")
        require_min(self, 1, "max_sampling_rounds")
        if self.gspo_clip_high <= 0:
            raise ConfigError(f"gspo_clip_high must be positive, got {self.gspo_clip_high}")
        if self.dynamic_sampling == "std_below" and self.dynamic_sampling_std <= 0:
            raise ConfigError("dynamic_sampling 'std_below' needs a positive "
                              f"dynamic_sampling_std, got {self.dynamic_sampling_std}; set one "
                              "(e.g. 0.1) or use dynamic_sampling 'all_equal'")
        if self.kl_ctrl == "adaptive":
            if self.kl_target is None or self.kl_target <= 0:
                raise ConfigError(f"kl_ctrl 'adaptive' needs a positive kl_target, got "
                                  f"{'null' if self.kl_target is None else self.kl_target}")
            if not self.kl_in_reward:
                raise ConfigError("kl_ctrl 'adaptive' tunes the in-reward penalty: set "
                                  "kl_in_reward to true or kl_ctrl to 'fixed'")
        if self.kl_in_reward and self.use_kl_loss:
            raise ConfigError("kl_in_reward and use_kl_loss are both true, so KL is penalised "
                              "twice; keep one of them")

    @property
    def policy_clip(self) -> tuple[float, float]:
        """(low, high) clip range of the policy loss: gspo_clip_* for the sequence ratio of
        gspo, clip_ratio_* for the token ratio of ppo (cispo caps its weight at 1 + high)."""
        if self.policy_loss == "gspo":
            return self.gspo_clip_low, self.gspo_clip_high
        return self.clip_ratio_low, self.clip_ratio_high

    @property
    def use_critic(self) -> bool:
        """Whether a critic is trained (exactly for GAE)."""
        return self.adv_estimator == "gae"

    @property
    def use_ref(self) -> bool:
        """Whether reference-policy log-probs are needed (any KL term)."""
        return self.kl_in_reward or self.use_kl_loss


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompt datasets (JSONL or Parquet files) and how they are batched."""

    train_files: tuple[str, ...] = ()
    """Training files, JSONL or Parquet (a path or a list of paths); required."""
    val_files: tuple[str, ...] = ()
    """Validation files, JSONL or Parquet; needed when trainer.val_every > 0."""
    prompt_key: str = "prompt"
    """Field of each row that holds the prompt."""
    ground_truth_key: str = "ground_truth"
    """Field of each row handed to the reward functions as the ground truth."""
    max_prompt_length: int = 512
    """Longest prompt, in tokens."""
    train_batch_size: int = 32
    """Prompts per training step (each sampled rollout.n times)."""
    val_batch_size: int = 64
    """Prompts per validation generation batch."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch."""
    seed: int = 0
    """Seed of the shuffling."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than max_prompt_length (otherwise stop with an error)."""

    def __post_init__(self):
        require_min(self, 1, "max_prompt_length", "train_batch_size", "val_batch_size")
        for key in ("prompt_key", "ground_truth_key"):
            if not getattr(self, key):
                raise ConfigError(f"{key} must not be empty")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The training loop, its devices and its outputs."""

    output_dir: str = "outputs/run"
    """Folder for checkpoints, logs and the resolved config."""
    total_steps: int = 100
    """Training steps (one step = one batch of prompts)."""
    val_every: int = 0
    """Validate every this many steps; 0 = never."""
    save_every: int = 0
    """Write a checkpoint every this many steps (and at the end); 0 = only at the end."""
    resume: str = "auto"
    """auto (the newest checkpoint in output_dir that verifies), never, or a checkpoint folder."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds another run: its checkpoints, metrics and
    exports are first moved aside to output_dir/old_runs/<time>."""
    allow_config_change: bool = False
    """Resume even though keys that define the run (model, algorithm, rewards, data, layouts)
    differ from the checkpoint's config."""
    seed: int = 0
    """Seed of training-side randomness (new value heads, mini-batch order)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when a GPU is present, else cpu."""
    nnodes: int = 1
    """Machines in the shared pool."""
    ranks_per_node: int = 1
    """Ranks per machine; the shared colocated pool has nnodes * ranks_per_node ranks."""
    experiment_name: str = "rlhf"
    """Name of the run in logs and trackers (the W&B run, the MLflow experiment and run)."""
    loggers: tuple[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"], ...] = (
        "console", "jsonl")
    """Where step metrics go, each with the run's config: console (progress bar), jsonl
    (output_dir/metrics.jsonl), tensorboard, wandb, mlflow (each needs its pip extra)."""
    wandb_project: str = "rlhf"
    """Weights & Biases project of the run (WANDB_MODE=offline logs without an account)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (a server or database); null = a SQLite store in
    output_dir/mlflow.db."""
    val_before_train: bool = True
    """Validate once before the first step (when val_every > 0), as the baseline."""
    ray_metrics: bool = True
    """Export every logged metric as a Ray gauge (Ray dashboard, Prometheus)."""
    max_keep: int = 0
    """Keep only this many newest checkpoints; 0 = keep all."""
    critic_warmup: int = 0
    """Train only the critic for this many first steps (the actor waits for useful values)."""
    device_memory_gb: float | None = None
    """Memory of one device in GiB for `rlhf plan`; null = the detected GPU (RAM on the CPU)."""
    host_memory_gb: float | None = None
    """RAM of one node in GiB for `rlhf plan`'s check of the offloaded state's pinned host
    copies; null = this machine's RAM."""
    skip_memory_check: bool = False
    """Start `rlhf train` even when `rlhf plan` predicts the job does not fit (experts only)."""
    init_timeout_s: float = 600.0
    """Seconds each role's ranks may take to start (build the model, load its weights) before
    the job stops; raise it for large models loaded from slow shared storage."""
    async_mode: Literal["off", "one_step", "bounded"] = "off"
    """off: generate then train; one_step: the rollout pool samples batch k+1 while the actor
    trains batch k, one policy version behind; bounded: up to max_staleness versions behind
    (both need rollout.placement separate)."""
    max_staleness: int = 1
    """Most policy versions a trained sample may lag (async_mode bounded; one_step is 1);
    older samples are dropped and counted."""
    async_old_log_probs: Literal["rollout", "recompute"] = "rollout"
    """Async ratio denominator: rollout = the sampling version's vLLM log-probs; recompute = the
    trainer's current weights (rollout.tis_cap then corrects towards the sampling version)."""

    def __post_init__(self):
        require_min(self, 1, "total_steps", "nnodes", "ranks_per_node")
        require_positive_or_none(self, "device_memory_gb", "host_memory_gb")
        if self.init_timeout_s <= 0:
            raise ConfigError(f"init_timeout_s must be positive, got {self.init_timeout_s}")
        require_min(self, 0, "val_every", "save_every", "max_keep", "critic_warmup")
        require_min(self, 1, "max_staleness")
        if self.async_mode == "one_step" and self.max_staleness != 1:
            raise ConfigError(f"async_mode one_step is max_staleness 1, got max_staleness="
                              f"{self.max_staleness}; use async_mode=bounded for a larger bound")
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"loggers lists a logger twice: {list(self.loggers)}")
        for key in ("output_dir", "resume", "experiment_name", "wandb_project"):
            if not getattr(self, key):
                raise ConfigError(f"{key} must not be empty")

    @property
    def pool_size(self) -> int:
        """Ranks of the shared pool that colocated roles live on."""
        return self.nnodes * self.ranks_per_node


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """How the driver joins or starts a Ray cluster."""

    address: str | None = None
    """Cluster to join, e.g. ray://host:10001 or auto; null = RAY_ADDRESS or a new local cluster."""
    num_cpus: int | None = None
    """CPUs of a new local cluster; null = all of this machine's."""
    include_dashboard: bool = False
    """Start the Ray dashboard with a new local cluster."""
    dashboard_port: int = 8265
    """Port of that dashboard."""
    namespace: str = "rlhf"
    """Ray namespace of the job's actors."""

    def __post_init__(self):
        if self.num_cpus is not None:
            require_min(self, 1, "num_cpus")
        require_range(self, "dashboard_port", 1, 65535)
        if self.address is not None and self.num_cpus is not None:
            raise ConfigError("num_cpus sizes a new local cluster but address joins an existing "
                              "one; remove one of them")
        if not self.namespace:
            raise ConfigError("namespace must not be empty")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A whole training job; `rlhf.config.load_config` builds and checks one."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The initial policy; also the reference policy and, by default, the critic's trunk."""
    actor: TrainRoleConfig = field(default_factory=TrainRoleConfig)
    """The policy's training plan, optimizer and batch sizes; its ranks also host vLLM rollouts."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model, trained exactly when algorithm.adv_estimator is gae."""
    ref: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The frozen reference policy, run when algorithm.kl_in_reward or use_kl_loss is on."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rule-based reward functions and an optional reward model (the role keys plan the model)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response sampling by the vLLM engine in each actor rollout replica."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation, KL regularisation and the clipped policy/value losses."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets (JSONL or Parquet files) and batch sizes."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The training loop, its devices and its outputs."""
    ray: RayConfig = field(default_factory=RayConfig)
    """How the driver joins or starts a Ray cluster."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning (`rlhf sft`) that warm-starts the policy."""

    def role_world_size(self, role: ForwardRoleConfig) -> int:
        """Ranks a role runs on: the shared pool when colocated, its own pool when separate."""
        return role.world_size if role.world_size is not None else self.trainer.pool_size
