"""Typed job configuration: frozen dataclasses, YAML loading with overrides, checks, reference.

`load_config(path, overrides)` is the entry point; it rejects unknown keys and inconsistent
values with a ConfigError that names the dotted key, before any process starts.
"""

from rlhf.config.checks import check_config
from rlhf.config.loader import config_from_dict, config_to_dict, format_config, load_config
from rlhf.config.reference import reference_markdown
from rlhf.config.roles import TRAINED_ROLES, AlgorithmNeeds, job_roles, ref_from_actor
from rlhf.config.schema import (
                                AlgorithmConfig,
                                CriticConfig,
                                DataConfig,
                                ForwardRoleConfig,
                                JobConfig,
                                LoraConfig,
                                ModelConfig,
                                OffloadConfig,
                                OptimizerConfig,
                                ParallelConfig,
                                RayConfig,
                                ReferenceConfig,
                                RewardConfig,
                                RewardFunctionConfig,
                                RolloutConfig,
                                SFTConfig,
                                TinyModelConfig,
                                TrainerConfig,
                                TrainRoleConfig,
                                sft_output_path,
)
from rlhf.errors import ConfigError

__all__ = [
    "TRAINED_ROLES", "AlgorithmConfig", "AlgorithmNeeds", "ConfigError", "CriticConfig", "DataConfig",
    "ForwardRoleConfig", "LoraConfig", "ref_from_actor",
    "JobConfig", "ModelConfig", "OffloadConfig", "OptimizerConfig", "ParallelConfig", "RayConfig",
    "ReferenceConfig", "RewardConfig", "RewardFunctionConfig", "RolloutConfig", "SFTConfig",
    "TinyModelConfig", "TrainerConfig",
    "TrainRoleConfig", "check_config", "config_from_dict", "config_to_dict", "format_config",
    "job_roles", "load_config", "reference_markdown", "sft_output_path",
]
