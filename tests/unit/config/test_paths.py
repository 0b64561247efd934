"""Paths of a job config resolved once, on the driver, against its working directory."""

import dataclasses
import typing
from pathlib import Path

import pytest

from rlhf.config import JobConfig, config_from_dict, format_config
from rlhf.config.loader import field_types, parse_yaml, unwrap_optional
from rlhf.config.paths import OBJECT_KEYS, PATH_KEYS, resolve_paths

# String keys that are not paths; a new string key must land here or in PATH_KEYS/OBJECT_KEYS.
NOT_PATHS = {"rollout.stop", "data.prompt_key", "data.ground_truth_key",
             "trainer.experiment_name", "ray.address", "ray.namespace", "sft.prompt_key",
             "sft.response_key", "sft.messages_key", "actor.lora.target_modules",
             "critic.lora.target_modules",
             "model.tiny.arch",  # a model family name (rlhf.families)
             # a W&B project name, and an MLflow URI (its scheme says where: a server or sqlite:)
             "trainer.wandb_project", "trainer.mlflow_tracking_uri"}

BASE = Path("/driver/cwd")


def relative_config(**trainer) -> JobConfig:
    return config_from_dict({
        "model": {"path": "models/policy", "tokenizer_path": "~/tok"},
        "critic": {"model_path": "models/critic"},
        "reward": {"functions": [{"path": "rlhf.rewards.arith:exact_match"},
                                 {"path": "rewards/mine.py:score"}],
                   "model_path": "/abs/rm"},
        "rollout": {"env": {"path": "envs/calc.py:Calc"}},
        "data": {"train_files": ["data/a.jsonl", "./data/../data/b.jsonl"],
                 "val_files": ["data/v.jsonl"]},
        "sft": {"train_files": ["data/s.jsonl"], "init_path": "models/base"},
        "trainer": {"output_dir": "runs/x", **trainer},
    })


def test_every_path_is_absolute_against_the_base():
    cfg = resolve_paths(relative_config(), base=BASE)
    assert cfg.model.path == "/driver/cwd/models/policy"
    assert cfg.model.tokenizer_path == str(Path("~/tok").expanduser())
    assert cfg.critic.model_path == "/driver/cwd/models/critic"
    assert cfg.reward.model_path == "/abs/rm"  # absolute paths stay as they are
    assert [f.path for f in cfg.reward.functions] == ["rlhf.rewards.arith:exact_match",
                                                       "/driver/cwd/rewards/mine.py:score"]
    assert cfg.rollout.env.path == "/driver/cwd/envs/calc.py:Calc"
    assert cfg.data.train_files == ("/driver/cwd/data/a.jsonl", "/driver/cwd/data/b.jsonl")
    assert cfg.data.val_files == ("/driver/cwd/data/v.jsonl",)
    assert cfg.sft.train_files == ("/driver/cwd/data/s.jsonl",)
    assert (cfg.sft.init_path, cfg.sft.output_path) == ("/driver/cwd/models/base", None)
    assert cfg.trainer.output_dir == "/driver/cwd/runs/x"
    assert cfg.trainer.resume == "auto"


def test_resume_folder_resolves_and_its_words_do_not():
    assert resolve_paths(relative_config(resume="runs/x/checkpoints/step_2"),
                         base=BASE).trainer.resume == "/driver/cwd/runs/x/checkpoints/step_2"
    assert resolve_paths(relative_config(resume="never"), base=BASE).trainer.resume == "never"


def test_resolving_twice_changes_nothing_and_round_trips_through_yaml():
    once = resolve_paths(relative_config(), base=BASE)
    assert resolve_paths(once, base=Path("/elsewhere")) == once
    assert config_from_dict(parse_yaml(format_config(once))) == once


def test_a_relative_base_is_refused():
    with pytest.raises(ValueError, match="absolute"):
        resolve_paths(relative_config(), base=Path("cwd"))


def _string_keys(cls, prefix=""):
    for name, tp in field_types(cls).items():
        inner, _ = unwrap_optional(tp)
        key = prefix + name
        if dataclasses.is_dataclass(inner):
            yield from _string_keys(inner, key + ".")
        elif typing.get_origin(inner) is tuple:
            item = typing.get_args(inner)[0]
            if dataclasses.is_dataclass(item):
                yield from _string_keys(item, key + "[].")
            elif item is str:
                yield key
        elif inner is str:
            yield key


def test_every_string_key_is_classified():
    """A new path key left out of PATH_KEYS would reach the workers relative again."""
    keys = set(_string_keys(JobConfig))
    assert keys == set(PATH_KEYS) | set(OBJECT_KEYS) | NOT_PATHS, keys ^ (
        set(PATH_KEYS) | set(OBJECT_KEYS) | NOT_PATHS)
