"""`rlhf train`, `rlhf sft` and `rlhf export-hf`; heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rlhf.errors import RLHFError
from rlhf.files import atomic_folder
from rlhf.config.loader import add_job_arguments

FINAL_MODEL = "hf_model"


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register the trainer's commands on the top-level subparsers."""
    for name, run, text in (
            ("train", _train, "PPO/GRPO training: connects to RAY_ADDRESS when set, else starts "
                              "a local Ray; writes trainer.output_dir"),
            ("sft", _sft, "supervised fine-tuning on prompt/answer rows (the sft section); "
                          "writes an HF folder to warm-start a policy")):
        parser = commands.add_parser(name, help=text)
        add_job_arguments(parser, example="trainer.total_steps=5 actor.parallel.tp=2")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")
        parser.set_defaults(run=run)
    export = commands.add_parser(
        "export-hf", help="write a Hugging Face folder of the policy in a training checkpoint")
    export.add_argument("checkpoint", help="a checkpoint folder, OUTPUT_DIR/checkpoints/step_N")
    export.add_argument("out", help="folder to create")
    export.set_defaults(run=_export_hf)


def _load(args):
    from rlhf.config import load_config
    from rlhf.config.paths import resolve_paths

    return resolve_paths(load_config(args.config, args.overrides), base=Path.cwd())


def env_address() -> str | None:
    """The launcher edge: `ray job submit` sets RAY_ADDRESS for the driver it starts."""
    return os.environ.get("RAY_ADDRESS") or None


def _start(args, command: str):
    """The checked config of `command`, with Ray joined or started (nothing else yet)."""
    from rlhf.config.preflight import check_cluster_fits, move_old_run_aside, preflight
    from rlhf.plan.report import check_fits
    from rlhf.logs import filter_worker_output, setup_driver_logging
    from rlhf.trainer.device import use_gpu
    from rlhf.trainer.session import init_ray

    cfg = _load(args)
    checked = preflight(cfg, command=command, ray_address=env_address())
    joins = bool(cfg.ray.address or env_address())
    # The plan refuses, before any worker, a job that won't fit; on a cluster it is made after
    # joining, since only the cluster knows whether trainer.device=auto means GPUs.
    if command == "train" and not joins:
        check_fits(cfg, config_path=args.config)
    if checked.move_old_run_aside:
        print(f"trainer.overwrite: moved the previous run aside to "
              f"{move_old_run_aside(cfg.trainer.output_dir)}", flush=True)
    log_dir = Path(cfg.trainer.output_dir) / ("logs" if command == "train" else "sft/logs")
    setup_driver_logging(log_dir)
    init_ray(cfg, env_address=env_address())
    filter_worker_output(log_dir)
    if joins:
        check_cluster_fits(cfg, command, use_gpu=use_gpu(cfg))
        if command == "train":
            check_fits(cfg, config_path=args.config)
    return cfg


def _train(args) -> int:
    cfg = _start(args, "train")
    records = run_train(cfg, progress=not args.no_progress)
    _print_summary(records, Path(cfg.trainer.output_dir))
    return 0


def _sft(args) -> int:
    from rlhf.trainer.sft import run_sft, sft_output_path

    cfg = _start(args, "sft")
    records = run_sft(cfg, job_name=f"{cfg.trainer.experiment_name}-sft",
                      progress=not args.no_progress)
    print(f"sft: loss {records[0]['sft/nll']:.4f} (step {records[0]['step']}) -> "
          f"{records[-1]['sft/nll']:.4f} (step {records[-1]['step']}); wrote "
          f"{sft_output_path(cfg)}", flush=True)
    return 0


def run_train(cfg, *, progress: bool = True) -> list[dict]:
    """Build the job's worker groups, train, export the policy to OUTPUT_DIR/hf_model.

    `rlhf train` checks the job's inputs first (rlhf.config.preflight); callers of this
    function directly may too."""
    from rlhf.config import format_config
    from rlhf.trainer.ppo import PPOTrainer
    from rlhf.trainer.session import RoleGroups
    from rlhf.trainer.setup import ensure_model, job_workers, load_tokenizer

    ensure_model(cfg.model.path, cfg.model.tiny)
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(format_config(cfg), encoding="utf-8")
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    roles, role_configs = job_workers(cfg)
    groups = RoleGroups(cfg, roles, job_name=cfg.trainer.experiment_name,
                        role_configs=role_configs)
    try:
        trainer = PPOTrainer(cfg, groups.views, tokenizer=tokenizer,
                             job_name=cfg.trainer.experiment_name, progress=progress)
        records = trainer.fit()
        with atomic_folder(out / FINAL_MODEL) as tmp:
            trainer.export_policy(tmp)
    finally:
        groups.shutdown()
    return records


def _print_summary(records: list[dict], out: Path) -> None:
    vals = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    if len(vals) >= 2:
        (s0, a0), (s1, a1) = vals[0], vals[-1]
        print(f"val/accuracy: {a0:.3f} at step {s0} -> {a1:.3f} at step {s1}", flush=True)
    print(f"metrics: {out / 'metrics.jsonl'}; policy: {out / FINAL_MODEL}", flush=True)


def _export_hf(args) -> int:
    cfg, folder = checkpoint_config(Path(args.checkpoint))
    from rlhf.trainer.session import init_ray

    init_ray(cfg, env_address=env_address())
    export_checkpoint(cfg, folder, Path(args.out))
    print(f"wrote the policy of {folder} to {args.out}")
    return 0


def checkpoint_config(folder: Path):
    """The JobConfig a checkpoint was written with."""
    from rlhf.config import config_from_dict
    from rlhf.trainer.checkpoint import CheckpointManager

    ckpt = CheckpointManager(folder.parent.parent)
    state = ckpt.load_state(ckpt.resolve(str(folder)))  # verified against its manifest first
    return config_from_dict(state["config"]), folder


def export_checkpoint(cfg, folder: Path, out: Path) -> Path:
    """Load the actor shards of checkpoint `folder` on the actor's layout; write an HF folder."""
    from rlhf.trainer.session import RoleGroups
    from workers.sft import SFTWorker

    if out.exists() and any(out.iterdir()):
        raise RLHFError(f"{out} exists and is not empty; give a new folder")
    spec = (SFTWorker, {"config": cfg, "init_path": cfg.model.path, "plan_key": "actor",
                        "train": False})
    groups = RoleGroups(cfg, {"export": spec}, job_name=f"{cfg.trainer.experiment_name}-export",
                        role_configs={"export": cfg.actor})
    try:
        view = groups.views["export"]
        view.load_checkpoint(str(folder / "actor"))
        with atomic_folder(out) as tmp:
            view.export_hf(str(tmp), cfg.model.path)
        return out
    finally:
        groups.shutdown()
