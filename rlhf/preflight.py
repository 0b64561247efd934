"""Everything a job reads, checked before anything starts: `rlhf config show` runs these checks
and `rlhf train` / `rlhf sft` run them again before Ray starts.

Files and folders must exist with the right kind (a model folder has config.json and
safetensors weights, a tokenizer folder a tokenizer, a data file a supported suffix and a
readable first row), the reward functions must import in a child process within
reward.import_timeout_s, the pool must fit the local Ray the job will start, a reward model
must have a value head, and the output folder must hold either nothing of another run or a
checkpoint that verifies and was written with the same run-defining config
(rlhf.trainer.run_folder). Paths are paths: nothing here (or later) looks a missing folder up on
a model hub.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlhf.algorithms import algorithm_needs
from rlhf.config import AlgorithmNeeds, JobConfig, job_roles, sft_output_path
from rlhf.data.dataset import SUFFIXES, _jsonl_records, _parquet_records, check_row
from rlhf.data.indexed import PROMPTS, SFT, IndexedDataset
from rlhf.envs.worker import load_env_class
from rlhf.errors import ConfigError, RLHFError
from rlhf.rewards.loader import check_reward_functions
from rlhf.trainer.device import use_gpu
from rlhf.trainer.loggers import missing_extras
from rlhf.trainer.run_folder import check_run_folder

Command = Literal["show", "train", "sft"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class Preflight:
    """What the checks found besides problems: lines to show, and whether to move a run aside."""

    notes: list[str] = field(default_factory=list)
    move_old_run_aside: bool = False
    restart: bool = False  # what is moved aside is an earlier attempt of this same run


def preflight(cfg: JobConfig, *, command: Command, ray_address: str | None) -> Preflight:
    """Check what `command` will read; raise one ConfigError listing every problem.

    command: "train" / "sft" check what that command reads; "show" checks both (allowing a
    model.path that `rlhf sft` will write). ray_address: the cluster the job will join (the
    launcher's RAY_ADDRESS); None with no ray.address means a local Ray sized by ray.num_cpus.
    """
    result = Preflight()
    needs = algorithm_needs(cfg)  # the config's own problems first, as load_config's are
    problems = list(_check_models(cfg, command, needs))
    if command in ("show", "train"):
        problems += _check_data(cfg.data.train_files, "data.train_files", cfg.data.prompt_key,
                                cfg.data.ground_truth_key)
        problems += _check_data(cfg.data.val_files, "data.val_files", cfg.data.prompt_key,
                                cfg.data.ground_truth_key)
        folder = check_run_folder(cfg)
        problems += folder.problems
        result.notes += folder.notes
        result.move_old_run_aside = folder.move_old_run_aside
        result.restart = folder.restart
        problems += _check_extras(cfg)
        problems += _check_reward_imports(cfg)
    if command == "sft" or (command == "show" and cfg.sft.total_steps > 0):
        problems += _check_data(cfg.sft.train_files, "sft.train_files", cfg.sft.prompt_key,
                                cfg.sft.response_key, messages_key=cfg.sft.messages_key)
    if not (cfg.ray.address or ray_address):
        problems += _check_local_pool(cfg, command)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems in the job's inputs:\n"
                          + "\n".join(f"  - {p}" for p in problems))
    return result


# ---- models and tokenizers -------------------------------------------------------------------

def _check_models(cfg: JobConfig, command: Command, needs: AlgorithmNeeds) -> Iterator[str]:
    if command in ("show", "train"):
        written_by_sft = (cfg.sft.total_steps > 0
                          and Path(cfg.model.path) == sft_output_path(cfg))
        if written_by_sft and command == "train" and not _has_config(cfg.model.path):
            yield (f"model.path={cfg.model.path!r} is where `rlhf sft` writes its model, and it "
                   "is not there yet; run `rlhf sft CONFIG` first")
        elif not written_by_sft:
            yield from _model_folder(cfg.model.path, "model.path", buildable=cfg.model.tiny,
                                     tokenizer=cfg.model.tokenizer_path is None)
        if needs.critic and cfg.critic.model_path is not None:
            yield from _model_folder(cfg.critic.model_path, "critic.model_path")
        if cfg.reward.model_path is not None:
            yield from _model_folder(cfg.reward.model_path, "reward.model_path", value_head=True)
    if command == "sft" and _has_config(str(sft_output_path(cfg))):
        yield (f"sft.output_path: {str(sft_output_path(cfg))!r} already holds a model; delete it "
               "or set sft.output_path to a new folder")
    if command == "sft" or (command == "show" and cfg.sft.total_steps > 0):
        key = "sft.init_path" if cfg.sft.init_path else "model.path"
        yield from _model_folder(cfg.sft.init_path or cfg.model.path, key,
                                 buildable=cfg.model.tiny,
                                 tokenizer=cfg.model.tokenizer_path is None)
    if cfg.model.tokenizer_path is not None:
        yield from _tokenizer_folder(cfg.model.tokenizer_path, "model.tokenizer_path")


def _has_config(path: str) -> bool:
    return (Path(path) / "config.json").is_file()


def _where(path: str) -> str:
    return "" if Path(path).is_absolute() else f" (relative to {str(Path.cwd())!r})"


def _model_folder(path: str, key: str, *, buildable=None, tokenizer: bool = False,
                  value_head: bool = False) -> Iterator[str]:
    folder = Path(path)
    if buildable is not None and not _has_config(path):
        return  # model.tiny builds it there before the workers start
    if not folder.exists():
        yield (f"{key}={path!r}: no such folder{_where(path)}; give a local Hugging Face model "
               "folder (paths are never looked up on a model hub)")
    elif not folder.is_dir():
        yield f"{key}={path!r} is a file, not a folder; give the model's folder"
    elif not os.access(folder, os.R_OK | os.X_OK):
        yield f"{key}={path!r} cannot be read (permissions)"
    elif not _has_config(path):
        yield f"{key}={path!r} has no config.json; give a Hugging Face model folder"
    elif not any((folder / name).is_file() for name in WEIGHT_FILES):
        yield (f"{key}={path!r} has no {' or '.join(WEIGHT_FILES)}; only safetensors weights "
               "are supported")
    elif value_head and "score.weight" not in _tensor_names(folder):
        yield (f"{key}={path!r} holds no value head (no score.weight tensor): it is a plain "
               "language model, which would score with a random head; give a sequence-scoring "
               "model (e.g. an exported critic or a *ForSequenceClassification folder)")
    elif tokenizer:
        yield from _tokenizer_folder(path, key, hint="; or set model.tokenizer_path")


def _tensor_names(folder: Path) -> set[str]:
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        from safetensors import safe_open

        with safe_open(folder / "model.safetensors", framework="pt", device="cpu") as f:
            return set(f.keys())
    except Exception as e:  # noqa: BLE001 - any failure to read the header is reported as such
        raise ConfigError(f"{folder}: cannot read the weights' tensor names ({e})") from None


def _tokenizer_folder(path: str, key: str, hint: str = "") -> Iterator[str]:
    folder = Path(path)
    if not folder.exists():
        yield (f"{key}={path!r}: no such folder{_where(path)}; give a local tokenizer folder "
               "(paths are never looked up on a model hub)")
    elif not folder.is_dir():
        yield f"{key}={path!r} is a file, not a folder; give the tokenizer's folder"
    elif not any((folder / name).is_file() for name in TOKENIZER_FILES):
        yield f"{key}={path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}){hint}"


# ---- data ------------------------------------------------------------------------------------

def _check_data(files, key: str, prompt_key: str, answer_key: str, *,
                messages_key: str | None = None) -> Iterator[str]:
    """Each file's first row checks; a folder is an indexed dataset of the kind `key` reads.
    With messages_key (sft), a row holding it is a chat transcript."""
    for i, name in enumerate(files):
        path, where = Path(name), f"{key}[{i}]={name!r}"
        if path.is_dir():
            try:
                IndexedDataset(path, kind=SFT if messages_key else PROMPTS)
            except RLHFError as e:
                yield f"{where}: {e}"
        elif path.suffix not in SUFFIXES:
            yield (f"{where}: unsupported data file type {path.suffix!r}; use JSON Lines "
                   "(.jsonl) or Parquet (.parquet)")
        elif not path.exists():
            yield f"{where} does not exist{_where(name)}"
        else:
            try:
                found = _first_record(path)
                if found is None:
                    yield f"{where} holds no rows"
                elif not (messages_key and isinstance(found[1], dict)
                          and messages_key in found[1]):
                    check_row(found[1], found[0], prompt_key=prompt_key,
                              ground_truth_key=answer_key)
            except OSError as e:
                yield f"{where} cannot be read ({e.strerror or e})"
            except RLHFError as e:
                yield f"{key}[{i}]: {e}"


def _first_record(path: Path):
    """(location, record) of a data file's first row, or None when it has none."""
    records = _jsonl_records(path) if path.suffix == ".jsonl" else _parquet_records(path)
    with contextlib.closing(records):
        return next(records, None)


# ---- rewards, extras, the Ray pool -----------------------------------------------------------

def _check_reward_imports(cfg: JobConfig) -> list[str]:
    try:
        check_reward_functions([fn.path for fn in cfg.reward.functions],
                               timeout_s=cfg.reward.import_timeout_s,
                               conventions=[fn.convention for fn in cfg.reward.functions])
    except ConfigError as e:
        return [str(e)]  # may span lines: a raising import comes with the user's traceback
    return _check_env_import(cfg)


def _check_env_import(cfg: JobConfig) -> list[str]:
    """rollout.env.path names an Env subclass that imports (in this process)."""
    if cfg.rollout.env.path is None:
        return []
    try:
        load_env_class(cfg.rollout.env.path)
    except RLHFError as e:
        return [f"rollout.env.path: {e}"]
    return []


def _check_extras(cfg: JobConfig) -> Iterator[str]:
    yield from missing_extras(cfg.trainer.loggers)


def pool_problems(cfg: JobConfig, command: Command, *, cpus: float, gpus: float | None,
                  where: str) -> list[str]:
    """The job's ranks (rlhf.trainer.jobs.least_rank_cpus CPUs each, plus one GPU each when
    `gpus` is given) against a cluster of `cpus` CPUs and `gpus` GPUs, described by `where`."""
    from rlhf.trainer.jobs import least_rank_cpus  # imports Ray: only when a pool is checked

    per_rank = {"CPU": least_rank_cpus(cfg), "GPU": 1}
    problems = []
    for label, roles in _jobs(cfg, command):
        shared = any(role.placement == "colocated" for role in roles.values())
        ranks = cfg.trainer.pool_size * shared + sum(
            role.world_size for role in roles.values() if role.placement == "separate")
        for kind, have in (("CPU", cpus), ("GPU", gpus)):
            if have is not None and ranks * per_rank[kind] > have:
                each = ("one" if per_rank[kind] == 1
                        else f"{per_rank[kind]} (trainer.cpus_per_rank)")
                problems.append(
                    f"{label} needs {ranks} ranks ({each} {kind} each: trainer.nnodes * "
                    f"trainer.ranks_per_node = {cfg.trainer.pool_size} shared"
                    + "".join(f", {n}.world_size={r.world_size}" for n, r in roles.items()
                              if r.placement == "separate")
                    + f") but {where} has {have:g} {kind}s; lower trainer.ranks_per_node or "
                    f"the world sizes" + (", or raise ray.num_cpus or lower "
                                          "trainer.cpus_per_rank" if kind == "CPU" else ""))
    return problems


def _jobs(cfg: JobConfig, command: Command):
    jobs = []
    if command in ("show", "train"):
        jobs.append(("the training job", job_roles(cfg, algorithm_needs(cfg))))
    if command == "sft" or (command == "show" and cfg.sft.total_steps > 0):
        jobs.append(("rlhf sft", {"sft": cfg.sft}))
    return jobs


def _check_local_pool(cfg: JobConfig, command: Command) -> list[str]:
    cpus = cfg.ray.num_cpus or os.cpu_count() or 1
    source = f"ray.num_cpus={cfg.ray.num_cpus}" if cfg.ray.num_cpus else "this machine"
    gpus = None
    if use_gpu(cfg):  # the local Ray counts this machine's GPUs
        import torch

        gpus = torch.cuda.device_count()
    return pool_problems(cfg, command, cpus=cpus, gpus=gpus,
                         where=f"the local Ray it starts ({source})")


def check_cluster_fits(cfg: JobConfig, command: Command, *, use_gpu: bool) -> None:
    """After joining an existing Ray cluster and before any worker starts: the pool fits it."""
    import ray

    have = ray.cluster_resources()
    problems = pool_problems(cfg, command, cpus=have.get("CPU", 0),
                             gpus=have.get("GPU", 0) if use_gpu else None,
                             where="the Ray cluster joined")
    if problems:
        raise ConfigError("\n".join(problems))
