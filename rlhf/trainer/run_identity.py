"""What makes two training runs the same run: the config keys a resume must not change.

A checkpoint's manifest stores the config it was written with and a fingerprint of these keys;
resuming compares them with the new config, so another model, algorithm, reward setup, data
or parallel layout pointed at an existing output_dir stops with the list of differing keys
instead of silently training on (or failing deep in a state-dict load). Keys outside this
list (total_steps, learning rates, logging, validation) may change between resumes.
"""

import hashlib
import json
from pathlib import Path

RUN_KEYS = (
    "model.path", "model.tokenizer_path",
    "algorithm.adv_estimator", "algorithm.kl_in_reward", "algorithm.use_kl_loss",
    "reward.functions", "reward.model_path",
    "data.train_files", "data.prompt_key", "data.ground_truth_key",
    "critic.model_path",
    "trainer.nnodes", "trainer.ranks_per_node",
    "actor.parallel", "actor.placement", "actor.world_size",
    "critic.parallel", "critic.placement", "critic.world_size",
)
_ABSENT = "<absent>"


def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def run_fingerprint(config: dict) -> str:
    """sha256 of the RUN_KEYS values of a config dict (as written by config_to_dict)."""
    identity = {key: _get(config, key) for key in RUN_KEYS}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def config_differences(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for every RUN_KEYS entry that differs."""
    lines = []
    for key in RUN_KEYS:
        old, new = _get(saved, key), _get(current, key)
        if old != new:
            lines.append(f"{key}: {_short(old)} -> {_short(new)}")
    return lines


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def model_config_digest(config: dict) -> str | None:
    """sha256 of model.path/config.json (None when absent): the same path may hold another
    model (e.g. another layer count) by the time a run resumes."""
    path = _get(config, "model.path")
    if not isinstance(path, str):
        return None
    try:
        return hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest()
    except OSError:
        return None
