"""The `sft` section: supervised fine-tuning on prompt/answer rows, used to warm-start a policy."""

from dataclasses import dataclass, field
from typing import Literal

from rlhf.config.roles import ForwardRoleConfig, OptimizerConfig
from rlhf.config.rules import require_min
from rlhf.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class SFTConfig(ForwardRoleConfig):
    """`rlhf sft`: token-mean NLL of the answer given the prompt, on the actor's engine code."""

    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-4))
    """Optimizer and learning-rate schedule (the schedule spans sft.total_steps)."""
    recompute: Literal["none", "attention_block", "full"] = "none"
    """Activation recomputation: none, attention_block (each layer's attention block) or full
    (whole layers)."""
    train_files: tuple[str, ...] = ()
    """Prompt/answer files, JSONL or Parquet; required by `rlhf sft`."""
    prompt_key: str = "prompt"
    """Field of each row that holds the prompt (rendered like data.prompt_key)."""
    response_key: str = "response"
    """Field of each row that holds the answer text to imitate (the EOS token is appended)."""
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
        for key in ("prompt_key", "response_key"):
            if not getattr(self, key):
                raise ConfigError(f"{key} must not be empty")
        for key in ("init_path", "output_path"):
            if getattr(self, key) == "":
                raise ConfigError(f"{key} must not be empty; use null for the default")
