"""Every path of a job config made absolute against the driver's working directory, once.

Workers on other nodes run in whatever folder `ray start` was run from there, so a relative
path would name another file (or none) on each node. The driver resolves the config before
anything ships to a worker; workers, checkpoints and `rlhf config show` only see the result.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rlhf.config.schema import ALGORITHM_ENTRIES, JobConfig

# Keys holding a file or folder (a list of them for the *_files keys).
PATH_KEYS = (
    "model.path", "model.tokenizer_path", "critic.model_path", "reward.model_path",
    "data.train_files", "data.val_files", "sft.train_files", "sft.init_path", "sft.output_path",
    "trainer.output_dir", "trainer.resume", "trainer.cost_model_path",
)
# Keys holding 'package.module:name' or 'path/to/file.py:name'; only the file form is a path.
OBJECT_KEYS = ("reward.functions[].path", "rollout.env.path",
               *(f"algorithm.{name}" for name in ALGORITHM_ENTRIES))
# trainer.resume's words that name no folder.
RESUME_WORDS = ("auto", "never")


def is_file_target(target: str) -> bool:
    """Whether the part before ':' of an object spec is a file path rather than a module name."""
    return target.endswith(".py") or "/" in target or "\\" in target


def absolute(path: str, *, base: Path) -> str:
    """`path` (with ~ expanded) joined to `base` when relative, normalised."""
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def resolve_paths(cfg: JobConfig, *, base: Path) -> JobConfig:
    """`cfg` with every path key (PATH_KEYS, and the file form of OBJECT_KEYS) absolute
    against `base`, the driver's working directory; nothing else changes."""
    if not base.is_absolute():
        raise ValueError(f"base must be an absolute folder, got {str(base)!r}")

    def one(value: str | None, key: str) -> str | None:
        if value is None or (key == "trainer.resume" and value in RESUME_WORDS):
            return value
        return absolute(value, base=base)

    def spec(value: str | None) -> str | None:
        if value is None:
            return None
        target, _, name = value.rpartition(":")
        return f"{absolute(target, base=base)}:{name}" if is_file_target(target) else value

    for key in PATH_KEYS:
        cfg = _update(cfg, key, lambda v, key=key: (tuple(one(p, key) for p in v)
                                                     if isinstance(v, tuple) else one(v, key)))
    functions = tuple(dataclasses.replace(fn, path=spec(fn.path)) for fn in cfg.reward.functions)
    cfg = _update(cfg, "reward.functions", lambda _: functions)
    for name in ALGORITHM_ENTRIES:  # a registered name has no ':' and stays as it is
        cfg = _update(cfg, f"algorithm.{name}", spec)
    return _update(cfg, "rollout.env.path", spec)


def _update(obj, dotted: str, change):
    """A copy of the frozen dataclass `obj` with the value at `dotted` replaced by change(value)."""
    head, _, rest = dotted.partition(".")
    value = getattr(obj, head)
    return dataclasses.replace(obj, **{head: _update(value, rest, change) if rest
                                       else change(value)})
