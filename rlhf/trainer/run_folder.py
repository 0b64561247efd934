"""The run folder (trainer.output_dir): before a training run starts, it must hold either
nothing of another run, or a checkpoint that verifies and was written with the same run-defining
config (rlhf.trainer.checkpoint.RUN_KEYS). Another model, algorithm, reward setup, data or
parallel layout pointed at an existing output_dir stops with the list of differing keys instead
of silently training on (or failing deep in a state-dict load); trainer.overwrite moves an
earlier run aside instead.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlhf.config import JobConfig, config_from_dict, config_to_dict
from rlhf.config.paths import resolve_paths
from rlhf.errors import ConfigError, RLHFError
from rlhf.trainer.checkpoint import (CheckpointManager, config_differences, model_config_digest,
                                     read_manifest)

# What a training run writes into trainer.output_dir; trainer.overwrite moves these aside.
RUN_ENTRIES = ("checkpoints", "metrics.jsonl", "config.yaml", "hf_model", "tensorboard", "logs",
               "wandb", "mlflow.db", "wandb_run_id", "mlflow_run_id")


@dataclass
class RunFolderCheck:
    """What `check_run_folder` found: problems, lines to show, whether to move a run aside."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    move_old_run_aside: bool = False


def check_run_folder(cfg: JobConfig) -> RunFolderCheck:
    """Whether trainer.output_dir can take this run under trainer.resume and trainer.overwrite."""
    result = RunFolderCheck()
    result.problems = list(_problems(cfg, result))
    return result


def _problems(cfg: JobConfig, result: RunFolderCheck):
    t, out = cfg.trainer, Path(cfg.trainer.output_dir)
    if out.exists() and not out.is_dir():
        yield f"trainer.output_dir={t.output_dir!r} is a file; give a folder"
        return
    ckpt = CheckpointManager(out)
    has_run = bool(ckpt.step_folders()) or (out / "metrics.jsonl").is_file()
    try:
        folder = ckpt.resolve(t.resume, report=result.notes.append)
    except RLHFError as e:
        if not (t.resume == "auto" and t.overwrite):
            yield f"trainer.resume={t.resume}: {e}"
            return
        folder = None
    if folder is None:
        if has_run and not t.overwrite:
            why = ("trainer.resume=never would start a new run over it" if t.resume == "never"
                   else "it has no checkpoint to resume")
            yield (f"trainer.output_dir={t.output_dir!r} holds another run (checkpoints/ or "
                   f"metrics.jsonl) and {why}; use another trainer.output_dir, or set "
                   f"trainer.overwrite=true to move the old run aside to "
                   f"{out / 'old_runs'} first")
        result.move_old_run_aside = has_run and t.overwrite
        return
    manifest, current = read_manifest(folder), config_to_dict(cfg)
    diffs = config_differences(_absolute_paths(manifest.get("config", {})), current)
    saved_model, model_now = manifest.get("model_config_sha256"), model_config_digest(current)
    if saved_model and model_now and saved_model != model_now:
        diffs.append(f"{cfg.model.path}/config.json: another model than the checkpoint's")
    if diffs and not t.allow_config_change:
        yield (f"trainer.resume={t.resume} resumes {folder}, but keys that define the run "
               f"differ from its config: {'; '.join(diffs)}; use another trainer.output_dir, "
               f"or set trainer.allow_config_change=true to resume anyway")
    result.notes.append(f"resuming from {folder}")


def move_old_run_aside(output_dir: str | Path) -> Path:
    """Move what a previous run wrote in output_dir into output_dir/old_runs/<UTC time>/."""
    out = Path(output_dir)
    dest = out / "old_runs" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest.mkdir(parents=True, exist_ok=False)
    for name in RUN_ENTRIES:
        if (out / name).exists():
            shutil.move(str(out / name), str(dest / name))
    return dest


def _absolute_paths(saved: dict) -> dict:
    """A checkpoint's config with its paths made absolute as the driver now makes them (a run
    saved before paths were resolved recorded them relative to its working directory)."""
    try:
        return config_to_dict(resolve_paths(config_from_dict(saved), base=Path.cwd()))
    except (ConfigError, ValueError):
        return saved  # a config this version cannot read: compared as written
