"""The run folder (trainer.output_dir): before a training run starts, it must hold either
nothing of another run, or a checkpoint that verifies and was written with the same run-defining
config (rlhf.trainer.checkpoint.RUN_KEYS). Another model, algorithm, reward setup or data
pointed at an existing output_dir stops with the list of differing keys instead of silently
training on, another model-parallel layout stops naming both layouts (instead of failing deep
in a state-dict load); trainer.overwrite moves an earlier run aside instead.

Each run writes RUN_FILE (its run-defining fingerprint and start time) before its first step,
so a folder left by an earlier attempt of the same command that was killed before its first
checkpoint completed is recognised: `resume=auto` moves those leftovers aside and starts over,
as a cluster that re-runs a failed job expects; another run's leftovers are still refused.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlhf.config import JobConfig, config_from_dict, config_to_dict
from rlhf.config.paths import resolve_paths
from rlhf.errors import ConfigError, RLHFError
from rlhf.files import atomic_write
from rlhf.trace import TRACE_DIR
from rlhf.trainer.checkpoint import (
    CheckpointManager,
    config_differences,
    fixed_layout_roles,
    layout_differences,
    model_config_digest,
    read_manifest,
    run_fingerprint,
)
from rlhf.trainer.loggers import METRICS_FILE, MLFLOW_ARTIFACTS, REPORT_FILE, SAMPLES_FILE

RUN_FILE = "run.json"  # the run's identity, written when it starts
# What a training run writes into trainer.output_dir; trainer.overwrite moves these aside.
RUN_ENTRIES = ("checkpoints", METRICS_FILE, "config.yaml", RUN_FILE, "hf_model",
               "tensorboard", "logs", "wandb", "mlflow.db", "wandb_run_id", "mlflow_run_id",
               SAMPLES_FILE, TRACE_DIR, REPORT_FILE, MLFLOW_ARTIFACTS)


@dataclass
class RunFolderCheck:
    """What `check_run_folder` found: problems, lines to show, whether to move a run aside."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    move_old_run_aside: bool = False
    restart: bool = False  # the folder holds an earlier attempt of this run, no checkpoint


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
    ckpt = CheckpointManager(out, full_hash=t.full_checkpoint_hash)
    has_run = bool(ckpt.step_folders()) or (out / "metrics.jsonl").is_file()
    try:
        folder = ckpt.resolve(t.resume, report=result.notes.append)
    except RLHFError as e:
        if not (t.resume == "auto" and t.overwrite):
            yield f"trainer.resume={t.resume}: {e}"
            return
        folder = None
    if folder is None:
        if has_run and not t.overwrite and t.resume == "auto" and _same_run(out, cfg):
            result.move_old_run_aside = result.restart = True
            result.notes.append(f"{out} holds an earlier attempt of this run that completed no "
                                "checkpoint: `rlhf train` moves it aside and starts from step 1")
            return
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
    saved = _absolute_paths(manifest.get("config", {}))
    layouts = layout_differences(saved, current, roles=fixed_layout_roles(folder))
    if layouts:
        yield (f"trainer.resume={t.resume} resumes {folder}, which was written at another "
               f"model-parallel layout: {'; '.join(layouts)}; it holds checkpoints of the "
               f"format before DCP, which reshard over the data-parallel size only (ranks, "
               f"nodes), not over tp, pp or ep: resume with the checkpoint's layout, or export "
               f"its policy (rlhf export-hf) and start a new run from that folder")
        return
    diffs = config_differences(saved, current)
    saved_model, model_now = manifest.get("model_config_sha256"), model_config_digest(current)
    if saved_model and model_now and saved_model != model_now:
        diffs.append(f"{cfg.model.path}/config.json: another model than the checkpoint's")
    if diffs and not t.allow_config_change:
        yield (f"trainer.resume={t.resume} resumes {folder}, but keys that define the run "
               f"differ from its config: {'; '.join(diffs)}; use another trainer.output_dir, "
               f"or set trainer.allow_config_change=true to resume anyway")
    result.notes.append(f"resuming from {folder}")


def write_run_identity(output_dir: str | Path, config: dict) -> Path:
    """RUN_FILE: the fingerprint of the run-defining keys of `config` (config_to_dict's) and
    the model's config.json, and the start time; written before the first step."""
    path = Path(output_dir) / RUN_FILE
    identity = {"config_fingerprint": run_fingerprint(config),
                "model_config_sha256": model_config_digest(config),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(identity, f, indent=1)
    return path


def _same_run(out: Path, cfg: JobConfig) -> bool:
    """Whether RUN_FILE in `out` says an earlier attempt of this very run wrote the folder."""
    try:
        identity = json.loads((out / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # no identity (an older version's run, or not ours): not provably ours
    current = config_to_dict(cfg)
    return (identity.get("config_fingerprint") == run_fingerprint(current)
            and identity.get("model_config_sha256") == model_config_digest(current))


def restart_line(output_dir: str | Path, moved_to: Path) -> str:
    """The one line saying an earlier attempt's leftovers were moved aside."""
    return (f"trainer.resume=auto: {output_dir} holds an earlier attempt of this run that "
            f"completed no checkpoint; moved its leftovers (metrics, partial checkpoints) "
            f"aside to {moved_to} and starting from step 1")


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
