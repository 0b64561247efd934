"""Where step metrics go: the console, metrics.jsonl, TensorBoard, Weights & Biases, MLflow.

`trainer.loggers` names them; each tracker's package is an optional extra, asked for by name
when it is missing. Every logger gets the run's resolved config once, at start. Sample tables
(trainer.samples_every) always go to output_dir/samples.jsonl, and to the trackers as a W&B
table, an MLflow JSON artifact, a TensorBoard text summary.
"""

from __future__ import annotations

import importlib.util
import json
import math
import secrets
import time
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from rlhf.errors import RLHFError

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # one row a line: {"step": ..., **row of rlhf.trainer.samples}
REPORT_FILE = "report.html"  # where `rlhf report` writes a run's page (rlhf.report)
MLFLOW_ARTIFACTS = "mlartifacts"  # the local MLflow store's artifacts (sample tables)
# Files a tracker leaves in output_dir to continue the same tracked run on resume.
WANDB_RUN_FILE = "wandb_run_id"
MLFLOW_RUN_FILE = "mlflow_run_id"
# logger -> (module it imports, the pyproject extra that installs it)
EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
          "mlflow": ("mlflow", "mlflow")}
# Shown on the progress bar (and first in `rlhf report`), in this order, when present:
# (metric, short label). KL to the reference (actor/kl_ref) and policy-vs-old KL of the update
# (actor/approx_kl) are different quantities with different labels.
HEADLINE_METRICS = (
    ("reward/mean", "reward"), ("val/accuracy", "val_acc"), ("actor/pg_loss", "pg"),
    ("actor/kl_ref", "kl_ref"), ("actor/approx_kl", "approx_kl"),
    ("critic/value_loss", "vf"), ("response_length/mean", "len"),
    ("throughput/tokens_per_s", "tok/s"), ("sft/nll", "nll"))


class Logger(Protocol):
    """One destination of step records."""

    def log(self, step: int, record: dict[str, Any]) -> None: ...

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def missing_extras(names) -> list[str]:
    """One message per configured logger whose package is not installed, naming the extra."""
    problems = []
    for name in names:
        if name in EXTRAS and importlib.util.find_spec(EXTRAS[name][0]) is None:
            module, extra = EXTRAS[name]
            problems.append(f"trainer.loggers has {name!r} but the {module} package is not "
                            f"installed; install the extra (pip install -e '.[{extra}]') or "
                            f"remove {name!r} from trainer.loggers")
    return problems


def read_jsonl(path: Path, *, growing: bool = False) -> list[dict]:
    """The objects of a JSON-lines file, in order ([] when there is none). `growing`: a job may
    be appending to it, so a last line still being written is left out."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if not growing or i < len(lines) - 1:
                raise RLHFError(f"{path} line {i + 1} is not JSON: {line[:80]!r}") from None
    return out


def read_metrics(output_dir: str | Path) -> list[dict]:
    """Every record of OUTPUT_DIR/metrics.jsonl, in order ([] when there is none)."""
    return read_jsonl(Path(output_dir) / METRICS_FILE)


def read_samples(output_dir: str | Path) -> list[dict]:
    """Every row of OUTPUT_DIR/samples.jsonl, in order ([] when there is none)."""
    return read_jsonl(Path(output_dir) / SAMPLES_FILE)


class StepRecords:
    """A JSON-lines file of records carrying their "step", appended to as a run goes; on
    resume, records after `start_step` (left by a run that stopped after its last checkpoint)
    are dropped so the file matches the state."""

    def __init__(self, path: Path, *, start_step: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_jsonl(path) if r.get("step", 0) <= start_step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._file = path.open("a", encoding="utf-8")

    def write(self, records: list[dict[str, Any]]) -> None:
        self._file.write("".join(json.dumps(r) + "\n" for r in records))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def table_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The columns of a sample table: every key of its rows, in first-seen order."""
    return list(dict.fromkeys(k for row in rows for k in row))


def build_loggers(names, *, output_dir: str | Path, run_name: str, config: dict,
                  total_steps: int, start_step: int, progress: bool = True,
                  wandb_project: str = "rlhf", mlflow_tracking_uri: str | None = None
                  ) -> list[Logger]:
    """The loggers `names` lists, each started with the run's `config` (a plain dict)."""
    problems = missing_extras(names)
    if problems:
        raise RLHFError("; ".join(problems))
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    made: list[Logger] = []
    for name in names:
        if name == "console":
            made.append(ConsoleLogger(run_name, total_steps=total_steps, start_step=start_step,
                                      progress=progress))
        elif name == "jsonl":
            made.append(JsonlLogger(out, start_step=start_step))
        elif name == "tensorboard":
            made.append(TensorBoardLogger(out / "tensorboard", config=config))
        elif name == "wandb":
            made.append(WandbLogger(out, project=wandb_project, run_name=run_name, config=config))
        elif name == "mlflow":
            made.append(MlflowLogger(out, tracking_uri=mlflow_tracking_uri,
                                     experiment=run_name, config=config))
        else:
            raise RLHFError(f"unknown logger {name!r}; choose from console, jsonl, "
                            f"{', '.join(EXTRAS)}")
    return made


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's float metrics (what a tracker can plot), without `step`."""
    return {k: v for k, v in record.items() if isinstance(v, float) and k != "step"}


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'actor': {'optim': {'lr': 1e-6}}} -> {'actor.optim.lr': 1e-6} (lists stay values)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class ConsoleLogger:
    """A progress bar with the headline metrics, and one line per validation."""

    def __init__(self, run_name: str, *, total_steps: int, start_step: int, progress: bool):
        self._bar = (tqdm(total=total_steps, initial=start_step, desc=run_name, unit="step",
                          dynamic_ncols=True, mininterval=1.0) if progress else None)

    def log(self, step: int, record: dict[str, Any]) -> None:
        line = (f"step {step}: val/accuracy={record['val/accuracy']:.4f}"
                if "val/accuracy" in record else None)
        if self._bar is None:
            if line:
                print(line, flush=True)
            return
        shown = {label: f"{record[k]:.4g}" for k, label in HEADLINE_METRICS if k in record}
        self._bar.set_postfix(shown, refresh=False)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        if line:
            self._bar.write(line)

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass  # tables are read in samples.jsonl or `rlhf report`, not on a progress bar

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class JsonlLogger:
    """One JSON object per step in output_dir/metrics.jsonl (StepRecords)."""

    def __init__(self, output_dir: Path, *, start_step: int):
        self._records = StepRecords(output_dir / METRICS_FILE, start_step=start_step)

    def log(self, step: int, record: dict[str, Any]) -> None:
        self._records.write([record])

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass  # samples.jsonl (MetricsLogger.log_samples) holds the tables beside metrics.jsonl

    def close(self) -> None:
        self._records.close()


class TensorBoardLogger:
    """Event files under output_dir/tensorboard; the config as a text summary at step 0."""

    def __init__(self, folder: Path, *, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(folder))
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, step: int, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns = table_columns(rows)
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
        self._writer.add_text("samples", "\n".join(lines), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run (online, or offline under WANDB_MODE=offline) with the config;
    a resumed job continues the run whose id it left in output_dir."""

    def __init__(self, output_dir: Path, *, project: str, run_name: str, config: dict):
        import wandb

        id_file = output_dir / WANDB_RUN_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        self.run = wandb.init(project=project, name=run_name, id=run_id, resume="allow",
                              config=config, dir=str(output_dir))
        id_file.write_text(run_id + "\n")

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=step)

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        columns = table_columns(rows)
        table = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An MLflow run (the experiment is the job's name) with the flattened config as params;
    without a tracking URI, a SQLite store in output_dir/mlflow.db (artifacts in
    output_dir/mlartifacts). A resumed job continues
    the run whose id it left in output_dir."""

    def __init__(self, output_dir: Path, *, tracking_uri: str | None, experiment: str,
                 config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = tracking_uri or f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
        # The client holds its own store: no process-wide active run or tracking URI is set.
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        id_file = output_dir / MLFLOW_RUN_FILE
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(experiment)
        # The local store keeps its artifacts (sample tables) in output_dir too, not in ./mlruns
        artifacts = None if tracking_uri else (output_dir / MLFLOW_ARTIFACTS).resolve().as_uri()
        experiment_id = (found.experiment_id if found is not None
                         else self.client.create_experiment(experiment,
                                                            artifact_location=artifacts))
        self.run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
        params = [Param(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v))
                  for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        id_file.write_text(self.run_id + "\n")

    def log(self, step: int, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = _millis()
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in scalars(record).items()
                   if math.isfinite(v)]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.client.log_text(self.run_id, json.dumps(rows, indent=1),
                             f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    # MLflow keys allow letters, digits, _ - . space / only.
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in key)


def _millis() -> int:
    return int(time.time() * 1000)
