"""The job configuration: one frozen `JobConfig` made of per-section dataclasses (which roles
a job creates is `rlhf.config.roles`).

Defaults live here and only here. Relative paths are relative to the working directory.
Checks that involve one section run in `__post_init__` (the small range checks they share come
first; their messages name the bare field, which the loader rewrites into the dotted key, so a
message reads the same from Python and from YAML); checks across sections, and against the
model's config.json, are in `rlhf.config.checks`.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from rlhf.errors import ConfigError
from rlhf.families import model_family


def require_min(obj, low: float, *names: str) -> None:
    """Raise ConfigError unless every named field of `obj` is at least `low`."""
    for name in names:
        value = getattr(obj, name)
        if value < low:
            raise ConfigError(f"{name} must be at least {low}, got {value}")


def require_range(obj, name: str, low: float, high: float, *, low_open: bool = False,
                  high_open: bool = False) -> None:
    """Raise ConfigError unless field `name` lies in the interval from `low` to `high`."""
    value = getattr(obj, name)
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{name} must be in {interval}, got {value}")


def require_positive_or_none(obj, *names: str) -> None:
    """Raise ConfigError unless every named optional field is None or > 0."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive (or null to turn it off), got {value}")


def require_placement(obj) -> None:
    """`placement` and `world_size` agree: separate needs world_size >= 1, colocated none."""
    if obj.placement == "separate" and obj.world_size is None:
        raise ConfigError("placement 'separate' needs world_size (the ranks of its own pool)")
    if obj.placement == "colocated" and obj.world_size is not None:
        raise ConfigError("world_size is only for placement 'separate'; a colocated role uses "
                          "trainer.nnodes * trainer.ranks_per_node ranks: remove world_size")
    if obj.world_size is not None:
        require_min(obj, 1, "world_size")


# vLLM's CPU attention kernels only exist for these head sizes.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Byte-level BPE needs its 256-symbol alphabet plus the special tokens before any merge.
MIN_TINY_VOCAB = 320


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """A Llama-family model small enough to train on two CPU cores."""

    arch: str = "llama"
    """Model family: a model_type registered in `rlhf.families` (`rlhf make-tiny-model --help`
    lists each with what sets it apart)."""
    num_layers: int = 4
    """Number of transformer layers."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention heads; hidden_size / num_heads is the head size (vLLM on CPU needs >= 32)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = 256
    """Width of the gated MLP."""
    vocab_size: int = 512
    """Embedding rows; the trained tokenizer has at most this many tokens."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + response) the model accepts."""
    seed: int = 0
    """Seed of the random weights and of the tokenizer's training text."""
    num_experts: int = 8
    """MoE families (qwen3_moe): routed experts per layer."""
    num_experts_per_tok: int = 2
    """MoE families: experts each token is routed to (top-k; probabilities renormalised)."""
    moe_intermediate_size: int = 64
    """MoE families: width of each expert's gated MLP."""

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings", "num_experts",
                     "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        model_family(self.arch, what="arch", error=ConfigError)
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must not exceed "
                              f"num_experts ({self.num_experts})")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                             f"({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.vocab_size < MIN_TINY_VOCAB:
            raise ConfigError(f"vocab_size must be at least {MIN_TINY_VOCAB} (byte-level BPE "
                             f"alphabet plus special tokens), got {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """An environment that answers every model turn (rlhf.envs.Env); null path = single turn."""

    path: str | None = None
    """'package.module:Class' or 'path/to/file.py:Class' (an rlhf.envs.Env); null = no environment."""
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)  # keeps configs hashable
    """Keyword arguments of the environment's constructor."""
    num_workers: int = 2
    """Environment worker processes per rollout rank (async_mode streaming: on the driver); 0 = in
    that process, no time limit."""
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
    min_new_tokens: int = 0
    """Shortest sampled response, in tokens: EOS and stop strings cannot end one earlier
    (vLLM's min_tokens; greedy validation answers are not held). A stress setting: with
    min_new_tokens = max_new_tokens every response has the length the memory plan budgets
    for, so a first step shows whether the job fits. Single-turn, non-streaming rollouts."""
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
    sleep_residual_gb: float | None = 3.0
    """GiB vLLM keeps on each of its GPUs beyond its weights and KV cache, asleep or awake
    (CUDA graphs, buffers sized by max_num_seqs, workspaces, its own communicators, kernels),
    as `rlhf plan` counts it. Feed back a run's `rollout/sleep_residual_gb`. The default is
    about twice the 1.38 GiB vLLM reported in use after sleep (CUDA context included) on an
    8-GPU GRPO run; null = the CUDA-graph pool alone (1 GiB; 0 with enforce_eager)."""
    sync_bucket_mb: float = 256.0
    """Weight sync moves full tensors in buckets of about this many MiB (peak extra memory)."""
    max_logprob_gap_p99: float | None = None
    """Stop the job when, after a weight sync, the 99th percentile of |log-prob| differences
    between vLLM's sampled tokens and the trainer's (rollout/logprob_gap_p99) exceeds this: a
    broken or half-synced engine. null = by the engine's dtype: 0.1 in float32, 1.0 in
    bfloat16 and float16. 1e9 turns the check off. p99 of a healthy sync of SmolLM2-135M on
    the CPU: 3e-5 (float32), 0.22 (bfloat16); one layer's weights missing: 3.3 to 14; k/v
    swapped in one layer: 2.5 to 14 (docs/benchmarks/2026-11-27-logprob-gap.md)."""
    tis_cap: float | None = None
    """Truncated importance sampling: weight tokens by min(pi_train / pi_vllm, cap); null = off."""
    seq_tis_cap: float | None = None
    """Sequence-level TIS: weight a response's tokens by min(pi_train(y) / pi_vllm(y), cap)."""
    reject_band: tuple[float, float] | None = None
    """[low, high]: mask responses whose per-token geometric-mean pi_train / pi_vllm leaves it."""
    token_band: tuple[float, float] | None = None
    """[low, high]: mask single tokens whose pi_train / pi_vllm leaves it (IcePop: e.g. [0.5,
    5]); the rest of their response still trains."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: a vLLM replica on every actor rank, synced in-process; separate: world_size
    rollout ranks of their own (no training engine), sent weights over a transfer group."""
    routing_replay: Literal["off", "rollout", "trainer"] = "off"
    """MoE routing replay: the trainer's forwards of a batch use recorded experts per token.
    rollout: those vLLM routed (CUDA only); trainer: those the old-log-prob forward chose."""
    world_size: int | None = None
    """Ranks of the separate rollout pool (a multiple of tp); set exactly when separate."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts: the environment that answers each model turn (rlhf/envs)."""
    max_turns: int = 1
    """Most model turns per episode when rollout.env is set (max_new_tokens is per turn)."""
    max_episode_tokens: int | None = None
    """Most response tokens of an episode (model + environment); null = max_turns x max_new_tokens."""

    @property
    def corrects_on_driver(self) -> bool:
        """Whether the driver weighs or masks the update by the trainer/sampler ratio
        (seq_tis_cap, reject_band, token_band): it needs the old log-probs before the update."""
        return (self.seq_tis_cap is not None or self.reject_band is not None
                or self.token_band is not None)

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
        if self.sleep_residual_gb is not None and self.sleep_residual_gb < 0:
            raise ConfigError(f"sleep_residual_gb must be >= 0 (a run's rollout/sleep_residual_gb)"
                              f" or null (estimate), got {self.sleep_residual_gb}")
        if self.max_logprob_gap_p99 is not None and not self.max_logprob_gap_p99 > 0:
            raise ConfigError(f"max_logprob_gap_p99 must be positive (1e9 turns the check off) "
                              f"or null (by the engine's dtype), got {self.max_logprob_gap_p99}")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ConfigError(f"tis_cap must be at least 1 (a cap below 1 down-weights every "
                              f"token) or null, got {self.tis_cap}")
        if self.seq_tis_cap is not None and self.seq_tis_cap < 1:
            raise ConfigError(f"seq_tis_cap must be at least 1 (a cap below 1 down-weights every "
                              f"response) or null, got {self.seq_tis_cap}")
        for name in ("reject_band", "token_band"):
            band = getattr(self, name)
            if band is not None and not 0 < band[0] <= 1 <= band[1]:
                raise ConfigError(f"{name} must be [low, high] with 0 < low <= 1 <= high (a "
                                  f"ratio of 1 means sampler and trainer agree), got {list(band)}")
        if "" in self.stop:
            raise ConfigError("stop must not contain an empty string")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_new_tokens must be between 0 and max_new_tokens "
                              f"({self.max_new_tokens}), got {self.min_new_tokens}")
        if self.min_new_tokens and self.env.path is not None:
            raise ConfigError("min_new_tokens holds back the end of one response; multi-turn "
                              "episodes (rollout.env) end turns themselves: set it to 0")
        require_min(self, 1, "max_turns")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise ConfigError(f"max_episode_tokens must be at least 1 or null, got "
                              f"{self.max_episode_tokens}")
        if self.env.path is not None and self.tp != 1:
            raise ConfigError(f"env: multi-turn rollouts run on replicas of one rank; set "
                              f"rollout.tp=1 (got {self.tp})")
        if self.routing_replay == "rollout" and self.env.path is not None:
            raise ConfigError("rollout.routing_replay=rollout records one generation's routes; "
                              "multi-turn episodes (rollout.env) need routing_replay=trainer "
                              "or off")
        require_placement(self)


Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # rlhf.engine.engine maps them to torch
AUTO_DTYPE = "auto"
# Activation recomputation modes (rlhf.engine.recompute applies them, rlhf.plan.memory sizes them).
Recompute = Literal["none", "attention_block", "full"]
RECOMPUTE_MODES: tuple[str, ...] = get_args(Recompute)
# torch.compile of the elementwise bodies (rlhf.parallel.fusion says what each means per device).
Compile = Literal["auto", "on", "off"]
COMPILE_CHOICES: tuple[str, ...] = get_args(Compile)

# How attention spans the cp ranks (rlhf.parallel.context_parallel / rlhf.parallel.ulysses).
CpAttention = Literal["all_gather", "ulysses"]
CP_ATTENTION_METHODS: tuple[str, ...] = get_args(CpAttention)


def ulysses_heads_problem(num_heads: int, num_kv_heads: int, cp: int) -> str | None:
    """Why Ulysses cannot split these (tp-local) head counts over `cp` ranks; None if it can."""
    if num_heads % cp:
        return f"{num_heads} query heads (per tp rank) do not split over cp={cp} ranks"
    if num_kv_heads % cp and cp % num_kv_heads:
        return (f"{num_kv_heads} KV heads (per tp rank) neither split over cp={cp} ranks nor "
                f"divide it (to be copied to cp / KV heads ranks each)")
    return None



# "pkg.module:function" or "path/to/file.py:function"
_MODULE_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def is_function_spec(spec: str) -> bool:
    """Whether `spec` looks like 'package.module:function' or 'path/to/file.py:function'."""
    target, sep, function = spec.rpartition(":")
    module_ok = target.endswith(".py") or _MODULE_TARGET.fullmatch(target)
    return bool(sep and module_ok and _IDENTIFIER.fullmatch(function))


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
    ep: int = 1
    """Expert-parallel size of MoE layers, carved out of data parallelism: divides dp and the
    model's number of experts; each rank holds num_experts / ep experts."""
    cp: int = 1
    """Context-parallel size: the cp ranks of a model replica split every packed micro-batch's
    tokens (a long sequence spans them all) and gather keys and values in attention
    (docs/guides/context-parallelism.md)."""
    cp_attention: CpAttention = "all_gather"
    """How attention spans the cp ranks when cp > 1: all_gather (every rank gathers the keys
    and values; any number of heads) or ulysses (an all-to-all over heads; needs the tp-local
    query heads divisible by cp and the KV heads divisible by cp or dividing it)."""

    def __post_init__(self):
        require_min(self, 1, "tp", "pp", "vpp", "ep", "cp")
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

    def ulysses_problem(self, num_heads: int, num_kv_heads: int) -> str | None:
        """Why this plan's Ulysses attention cannot split a model of these head counts (cp > 1
        and cp_attention ulysses; the tp split of the heads is checked apart); None if it can
        or the plan does not use Ulysses."""
        tp = self.tp
        if self.cp == 1 or self.cp_attention != "ulysses" or num_heads % tp or num_kv_heads % tp:
            return None
        return ulysses_heads_problem(num_heads // tp, num_kv_heads // tp, self.cp)

    @property
    def model_ranks(self) -> int:
        """Ranks of one data-parallel replica: tp * cp * pp (dp takes the rest)."""
        return self.tp * self.cp * self.pp


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
    overlap_grad_reduce: bool = True
    """Start each grad bucket's data-parallel sum during the last micro-batch's backward, as
    soon as its grads are final (the same sums as after backward, hidden behind compute)."""

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


# The decoder's linear layers LoRA can adapt, by peft's (Hugging Face's) module names; the
# embedding, LM head and value head are never adapted.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_ALL_LINEAR = "all-linear"


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapters on the decoder's linear layers, with peft's names; the base stays frozen."""

    r: int = 0
    """Adapter rank; 0 = LoRA off (every weight is trained)."""
    lora_alpha: float = 8.0
    """Scale numerator: the adapter output is multiplied by lora_alpha / r (peft's default 8)."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input during training, in [0, 1)."""
    target_modules: tuple[str, ...] = (LORA_ALL_LINEAR,)
    """Module names to adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or
    [all-linear] for all seven."""
    use_rslora: bool = False
    """Rank-stabilised scaling lora_alpha / sqrt(r) instead of lora_alpha / r."""

    def __post_init__(self):
        require_min(self, 0, "r")
        if self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha must be positive, got {self.lora_alpha}")
        require_range(self, "lora_dropout", 0, 1, high_open=True)
        names = list(self.target_modules)
        if not names:
            raise ConfigError("target_modules is empty; list module names or use [all-linear]")
        if LORA_ALL_LINEAR in names and len(names) > 1:
            raise ConfigError(f"target_modules {names}: all-linear already means every linear "
                              "layer; give it alone or list the names")
        unknown = [n for n in names if n not in (*LORA_TARGET_MODULES, LORA_ALL_LINEAR)]
        if unknown:
            raise ConfigError(f"target_modules has unknown module names {unknown}; the model's "
                              f"linear layers are {list(LORA_TARGET_MODULES)} (or all-linear)")
        if len(set(names)) != len(names):
            raise ConfigError(f"target_modules lists a name twice: {names}")

    @property
    def enabled(self) -> bool:
        """Whether the role trains adapters (r > 0) rather than every weight."""
        return self.r > 0

    @property
    def modules(self) -> tuple[str, ...]:
        """The adapted module names, all-linear expanded, in the decoder's order."""
        if LORA_ALL_LINEAR in self.target_modules:
            return LORA_TARGET_MODULES
        return tuple(n for n in LORA_TARGET_MODULES if n in self.target_modules)


@dataclass(frozen=True, kw_only=True)
class ForwardRoleConfig:
    """A role that only runs forward passes (reference policy, reward model)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/pipeline layout of this role."""
    dtype: Dtype = "auto"
    """Parameter and compute dtype; auto = bfloat16 on CUDA, float32 on CPU."""
    compile: Compile = "auto"
    """torch.compile of the elementwise work (norms, RoPE, gated activation, residual adds, the
    LM head's per-chunk passes; GEMMs and attention stay eager): auto = on CUDA, off on CPU
    (a process's first compile costs tens of seconds there); off = eager everywhere."""
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
    recompute: Recompute = "none"
    """Activation recomputation: none, attention_block (each layer's attention block) or full
    (whole layers)."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step (each brings rollout.n samples); divides data.train_batch_size."""
    micro_batch_size: int | None = None
    """Optional cap on samples per micro-batch, on top of the token budget; null = tokens only."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """What this role moves to host memory around rollouts (see rlhf/engine/offload.py)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (off unless lora.r > 0): train low-rank adapters on a frozen base."""
    router_aux_loss_coef: float | None = None
    """MoE models: weight of the router load-balancing loss added to the training loss; null =
    the checkpoint's router_aux_loss_coef; must be 0 with parallel.pp > 1. Dense models ignore it."""

    def __post_init__(self):
        super().__post_init__()
        require_min(self, 1, "ppo_mini_batch_size")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ConfigError(f"router_aux_loss_coef must be >= 0 (or null for the model's), got "
                              f"{self.router_aux_loss_coef}")
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


# How a reward function is called (rlhf.rewards.protocol): ours, verl's compute_score, or
# told apart by its parameters (verl's has solution_str).
RewardConvention = Literal["auto", "rlhf", "verl"]
REWARD_CONVENTIONS: tuple[str, ...] = get_args(RewardConvention)


@dataclass(frozen=True, kw_only=True)
class RewardFunctionConfig:
    """One rule-based reward function and its weight in the total reward."""

    path: str
    """'package.module:function' or 'path/to/file.py:function'."""
    weight: float = 1.0
    """Multiplier of this function's score in the summed reward."""
    convention: RewardConvention = "auto"
    """How it is called: rlhf = fn(*, prompt, response, ground_truth, extra); verl =
    compute_score(data_source, solution_str, ground_truth, extra_info); auto = verl's when the
    function has a solution_str parameter, else ours."""

    def __post_init__(self):
        if not is_function_spec(self.path):
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


def sft_output_path(cfg: "JobConfig") -> Path:
    """Where `rlhf sft` writes the fine-tuned HF folder."""
    return Path(cfg.sft.output_path or Path(cfg.trainer.output_dir) / "sft_model")



@dataclass(frozen=True, kw_only=True)
class SFTConfig(ForwardRoleConfig):
    """`rlhf sft`: token-mean NLL of the answer given the prompt, on the actor's engine code."""

    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-4))
    """Optimizer and learning-rate schedule (the schedule spans sft.total_steps)."""
    recompute: Recompute = "none"
    """Activation recomputation: none, attention_block (each layer's attention block) or full
    (whole layers)."""
    train_files: tuple[str, ...] = ()
    """Prompt/answer or chat transcript files, JSONL or Parquet, or folders made by
    `rlhf preprocess-data --kind sft`; required by `rlhf sft`."""
    train_weights: tuple[float, ...] = ()
    """One weight per train_files folder: blend them in these proportions; empty = each row
    once per epoch."""
    prompt_key: str = "prompt"
    """Field of each row that holds the prompt (rendered like data.prompt_key)."""
    response_key: str = "response"
    """Field of each row that holds the answer text to imitate (the EOS token is appended)."""
    messages_key: str = "messages"
    """Field of a chat transcript row (system/user/assistant/tool messages), rendered with the
    chat template; the loss counts only the assistant turns. Rows without it are prompt/answer."""
    batch_size: int = 32
    """Samples per optimizer step."""
    total_steps: int = 0
    """Optimizer steps; 0 = no supervised fine-tuning."""
    init_path: str | None = None
    """HF folder SFT starts from; null = model.path. Built from model.tiny when missing."""
    output_path: str | None = None
    """HF folder SFT writes; null = <trainer.output_dir>/sft_model. Point model.path here to
    start PPO from the fine-tuned policy."""
    log_every: int = 10
    """Print and log the loss every this many steps."""

    def __post_init__(self):
        super().__post_init__()
        require_min(self, 1, "batch_size", "log_every")
        require_min(self, 0, "total_steps")
        for key in ("prompt_key", "response_key", "messages_key"):
            if not getattr(self, key):
                raise ConfigError(f"{key} must not be empty")
        require_weights(self)
        for key in ("init_path", "output_path"):
            if getattr(self, key) == "":
                raise ConfigError(f"{key} must not be empty; use null for the default")


def require_weights(obj) -> None:
    """train_weights is empty or one positive weight per train_files entry."""
    weights, files = obj.train_weights, obj.train_files
    if weights and len(weights) != len(files):
        raise ConfigError(f"train_weights has {len(weights)} weights for {len(files)} "
                          f"train_files; give one per file, or none")
    if any(not w > 0 for w in weights):
        raise ConfigError(f"train_weights must be positive, got {list(weights)}")


# AlgorithmConfig's fields that name a registry entry (or a user function, 'module:function').
ALGORITHM_ENTRIES = ("adv_estimator", "policy_loss", "kl_penalty", "kl_loss_type",
                     "kl_ctrl", "loss_agg_mode", "dynamic_sampling")


def require_entry(obj, *names: str) -> None:
    """Every named field is a registry entry's name or 'package.module:function' /
    'path/to/file.py:function'. Which names exist is the registries' business: the check at
    the algorithms layer (rlhf.algorithms.algorithm_needs) looks them up before the job starts."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name} must be a registered name or 'package.module:function', "
                              f"got {value!r}")
        if ":" in value and not is_function_spec(value):
            raise ConfigError(f"{name} must look like 'package.module:function' or "
                              f"'path/to/file.py:function', got {value!r}")
        if ":" not in value and not _IDENTIFIER.fullmatch(value.replace("-", "_")):
            raise ConfigError(f"{name} must be a registered name (letters, digits, _ and -) or "
                              f"'package.module:function', got {value!r}")


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

    adv_estimator: str = "gae"
    """Advantage estimator: gae (trains a critic), grpo, rloo, reinforce_plus_plus_baseline
    (these three compare the rollout.n responses of a prompt), reinforce_plus_plus, or your
    own as 'package.module:function' / 'path/to/file.py:function' (see the algorithms guide)."""
    gamma: float = 1.0
    """Discount factor of GAE and REINFORCE++ returns."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group std (false = Dr. GRPO)."""
    kl_in_reward: bool = False
    """Subtract kl_coef * KL(policy || ref) from the token rewards."""
    kl_penalty: str = "k1"
    """KL estimator of the in-reward penalty: k1, k2, k3, abs, or 'package.module:function'."""
    kl_coef: float = 0.001
    """Coefficient of the in-reward KL penalty (initial value when kl_ctrl is adaptive)."""
    kl_ctrl: str = "fixed"
    """Controller of the in-reward KL coefficient: fixed (kl_coef throughout), adaptive (moves
    it towards kl_target), or your own as 'package.module:function'."""
    kl_target: float | None = None
    """Target KL per sequence of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon (in samples) of the adaptive controller."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || ref) to the actor loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: str = "k3"
    """KL estimator of the KL loss: k1, k2, k3, abs, or 'package.module:function'."""
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
    loss_agg_mode: str = "token-mean"
    """How token losses are reduced to one number: token-mean, seq-mean-token-sum,
    seq-mean-token-mean, seq-mean-token-sum-norm, or your own as 'package.module:function'."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    policy_loss: str = "ppo"
    """Policy loss: ppo (token ratio), gspo (sequence ratio), cispo (clipped IS weight), or
    your own as 'package.module:function' / 'path/to/file.py:function'."""
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
    dynamic_sampling: str = "off"
    """Drop prompt groups without reward spread and refill the batch with fresh prompts: off,
    all_equal, std_below (needs dynamic_sampling_std), or a group filter of your own as
    'package.module:function'."""
    dynamic_sampling_std: float = 0.0
    """std_below (any filter that requires std_threshold): drop groups whose reward std is
    below this (must be positive)."""
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
        require_positive_or_none(self, "value_clip", "kl_target")
        require_range(self, "gspo_clip_low", 0, 1, low_open=True, high_open=True)
        require_min(self, 0, "overlong_buffer", "overlong_penalty", "dynamic_sampling_std")
        require_min(self, 1, "max_sampling_rounds")
        if self.gspo_clip_high <= 0:
            raise ConfigError(f"gspo_clip_high must be positive, got {self.gspo_clip_high}")
        require_entry(self, *ALGORITHM_ENTRIES)
        if self.kl_in_reward and self.use_kl_loss:
            raise ConfigError("kl_in_reward and use_kl_loss are both true, so KL is penalised "
                              "twice; keep one of them")

    @property
    def use_ref(self) -> bool:
        """Whether reference-policy log-probs are needed (any KL term)."""
        return self.kl_in_reward or self.use_kl_loss


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompt datasets (JSONL or Parquet files) and how they are batched."""

    train_files: tuple[str, ...] = ()
    """Training files, JSONL or Parquet (a path or a list of paths), or folders made by
    `rlhf preprocess-data` (read by memory map); required."""
    train_weights: tuple[float, ...] = ()
    """One weight per train_files folder: blend them in these proportions; empty = each row
    once per epoch."""
    val_files: tuple[str, ...] = ()
    """Validation files, JSONL or Parquet, or preprocessed folders; needed when
    trainer.val_every > 0."""
    prompt_key: str = "prompt"
    """Field of each row that holds the prompt: a string or a list of {role, content} messages
    (a dotted key such as a.b reads a nested field)."""
    ground_truth_key: str = "ground_truth"
    """Field of each row handed to the reward functions as the ground truth; dotted for a
    nested one (verl's rows: reward_model.ground_truth)."""
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
        require_weights(self)


@dataclass(frozen=True, kw_only=True)
class ValSamplingConfig:
    """Sampled validation: n answers to each held-out prompt beside the greedy one, scored as
    val/reward_mean@sampled and val/pass@k (docs/reference/metrics.md)."""

    n: int = 0
    """Answers sampled per validation prompt; 0 = greedy validation only."""
    temperature: float = 1.0
    """Sampling temperature of those answers, in (0, 2]."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 = off."""
    pass_score: float = 1.0
    """An answer passes when its reward is at least this; pass@k counts passes."""

    def __post_init__(self):
        require_min(self, 0, "n")
        require_range(self, "temperature", 0, 2, low_open=True)
        require_range(self, "top_p", 0, 1, low_open=True)
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"top_k must be -1 (off) or at least 1, got {self.top_k}")


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
    """Resume even though keys that define the run (model, algorithm, rewards, data) differ
    from the checkpoint's config (another layout needs no flag; pre-DCP checkpoints refuse tp/pp)."""
    seed: int = 0
    """Seed of training-side randomness (new value heads, mini-batch order)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when a GPU is present, else cpu."""
    nnodes: int = 1
    """Machines in the shared pool."""
    ranks_per_node: int = 1
    """Ranks per machine; the shared colocated pool has nnodes * ranks_per_node ranks."""
    cpus_per_rank: int | None = None
    """CPUs each rank reserves in Ray and runs torch's intra-op threads on (host packing,
    pinned copies, vLLM's scheduler); null = the node's CPUs split over its ranks, at most 4
    with GPUs (rlhf.trainer.jobs.rank_cpus)."""
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
    val_sampling: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    """Sampled validation (n answers per prompt, pass@k) beside the greedy answers."""
    ray_metrics: bool = True
    """Export every logged metric as a Ray gauge (Ray dashboard, Prometheus)."""
    max_keep: int = 0
    """Keep only this many newest checkpoints; 0 = keep all."""
    full_checkpoint_hash: bool = False
    """On resume, check every byte's sha256 (minutes for a large run), not sizes and quick digests."""
    async_checkpoint: bool = False
    """Write checkpoints in the background: a save stops training only while each rank copies
    its state to host memory (once more the state's size in RAM), step_N appears when written."""
    critic_warmup: int = 0
    """Train only the critic for this many first steps (the actor waits for useful values)."""
    device_memory_gb: float | None = None
    """Memory of one device in GiB for `rlhf plan`; null = the detected GPU (RAM on the CPU)."""
    host_memory_gb: float | None = None
    """RAM of one node in GiB for `rlhf plan`'s check of the offloaded state's pinned host
    copies; null = this machine's RAM."""
    nccl_nvls: bool = True
    """Let NCCL use NVLink SHARP (NVLS) on NVSwitch machines (its default): faster all-reduce
    within a node, about 1 GiB more device memory per communicator with two or more ranks on
    one node, which `rlhf plan` counts. false starts the workers with NCCL_NVLS_ENABLE=0."""
    skip_memory_check: bool = False
    """Start `rlhf train` even when `rlhf plan` predicts the job does not fit (experts only)."""
    init_timeout_s: float = 600.0
    """Seconds each role's ranks may take to start (build the model, load its weights) before
    the job stops; raise it for large models loaded from slow shared storage."""
    async_mode: Literal["off", "one_step", "bounded", "streaming"] = "off"
    """off: generate then train; one_step: the rollout pool samples batch k+1 while the actor
    trains batch k, one policy version behind; bounded: up to max_staleness versions behind;
    streaming: the pool generates continuously in segments, hands over finished groups and
    continues samples in flight under new weights (all need rollout.placement separate)."""
    max_staleness: int = 1
    """Most policy versions a trained sample (streaming: any token) may lag (bounded and
    streaming; one_step is 1); bounded drops older samples, streaming applies stale_policy."""
    stale_policy: Literal["drop", "regenerate"] = "regenerate"
    """async_mode streaming: a sample with a token past max_staleness is regenerated from
    scratch (regenerate) or its whole group dropped (drop); both counted."""
    stream_segment_tokens: int = 64
    """async_mode streaming: most new tokens per sample per segment; between segments finished
    groups go to the trainer and new weights to the rollout pool."""
    stream_slots: int = 0
    """async_mode streaming: samples generating at once; 0 = one batch's
    (data.train_batch_size * rollout.n). At least rollout.n (a group starts whole)."""
    stream_wait_timeout_s: float = 1800.0
    """async_mode streaming: seconds the driver waits for one segment of the rollout pool
    before it stops the job, naming what it waited for and the stream's state."""
    async_old_log_probs: Literal["rollout", "recompute"] = "rollout"
    """Async ratio denominator: rollout = the sampling version's vLLM log-probs; recompute = the
    trainer's current weights (rollout.tis_cap then corrects towards the sampling version)."""
    save_on_signal: bool = True
    """On SIGTERM/SIGINT, finish the current step, save a checkpoint and exit with status 75
    (a second signal exits at once); false = the signal stops the run as Python would."""
    max_hours: float | None = None
    """Stop like on a signal (checkpoint, status 75) when another step would end past this many
    hours of training: set it below a scheduler's time limit; null = no limit."""
    micro_batching: Literal["token_budget", "cost_model"] = "token_budget"
    """How each role's batches are cut into micro-batches: token_budget (first-fit under
    max_tokens_per_micro_batch, DP ranks balanced by an analytic cost) or cost_model (the cut
    and order that minimise the time `rlhf profile` predicts, under its memory limit; not with
    parallel.ep > 1)."""
    cost_model_path: str | None = None
    """The cost model file `rlhf profile` writes and cost_model reads; null =
    output_dir/cost_model.json."""
    trace: Literal["off", "every_n", "steps"] = "every_n"
    """Step timeline (output_dir/trace/step_NNNNNN.json, Chrome trace / Perfetto: every role
    method on every rank, micro-batches, offload, rewards): off; every_n = step 1 and every
    trace_every-th step; steps = the steps in trace_steps."""
    trace_every: int = 10
    """trace every_n: trace every this many steps (and step 1)."""
    trace_steps: tuple[int, ...] = ()
    """trace steps: the steps to trace."""
    samples_every: int = 10
    """Write a sample table every this many steps (and step 1) to output_dir/samples.jsonl and
    the trackers that hold tables (W&B, MLflow, TensorBoard); 0 = never."""
    samples_rows: int = 8
    """Rows of each sample table: the lowest and the highest rewarded samples of the step."""
    pipeline_schedule: Literal["configured", "auto"] = "configured"
    """A pipelined role's schedule: configured (1F1B at parallel.vpp 1, interleaved above) or
    auto (with micro_batching=cost_model, a role at parallel.vpp > 1 runs 1F1B or interleaved
    at that vpp, whichever its cost model predicts faster; chosen at the start and printed)."""

    def __post_init__(self):
        require_min(self, 1, "total_steps", "nnodes", "ranks_per_node")
        if self.cpus_per_rank is not None:
            require_min(self, 1, "cpus_per_rank")
        require_positive_or_none(self, "device_memory_gb", "host_memory_gb", "max_hours")
        if self.init_timeout_s <= 0:
            raise ConfigError(f"init_timeout_s must be positive, got {self.init_timeout_s}")
        require_min(self, 0, "val_every", "save_every", "max_keep", "critic_warmup")
        require_min(self, 1, "max_staleness", "trace_every", "samples_rows")
        require_min(self, 0, "samples_every", "stream_slots")
        require_min(self, 1, "stream_segment_tokens")
        if self.stream_wait_timeout_s <= 0:
            raise ConfigError(f"stream_wait_timeout_s must be positive, got "
                              f"{self.stream_wait_timeout_s}")
        if self.trace == "steps" and not self.trace_steps:
            raise ConfigError("trace is 'steps' but trace_steps is empty; list the steps to "
                              "trace (trainer.trace_steps=[1,50]) or use trace=every_n")
        if any(s < 1 for s in self.trace_steps):
            raise ConfigError(f"trace_steps must be step numbers from 1, got "
                              f"{list(self.trace_steps)}")
        if self.pipeline_schedule == "auto" and self.micro_batching != "cost_model":
            raise ConfigError("pipeline_schedule=auto chooses the schedule by the cost model; "
                              "set micro_batching=cost_model (and run `rlhf profile`) or "
                              "pipeline_schedule=configured")
        if self.async_mode == "one_step" and self.max_staleness != 1:
            raise ConfigError(f"async_mode one_step is max_staleness 1, got max_staleness="
                              f"{self.max_staleness}; use async_mode=bounded for a larger bound")
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"loggers lists a logger twice: {list(self.loggers)}")
        for key in ("output_dir", "resume", "experiment_name", "wandb_project"):
            if not getattr(self, key):
                raise ConfigError(f"{key} must not be empty")

    def traces(self, step: int) -> bool:
        """Whether step `step`'s timeline is recorded (trace, trace_every, trace_steps)."""
        if self.trace == "every_n":
            return step == 1 or step % self.trace_every == 0
        return self.trace == "steps" and step in self.trace_steps

    def samples(self, step: int) -> bool:
        """Whether step `step` writes a sample table (samples_every)."""
        return self.samples_every > 0 and (step == 1 or step % self.samples_every == 0)

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
    """The policy's parallel layout, optimizer and batch sizes; its ranks also host vLLM rollouts."""
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
