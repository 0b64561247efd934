"""Step metrics: one record per step, sent to the configured loggers and to Ray gauges."""

from __future__ import annotations

import math
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

from rlhf.trace import span
from rlhf.trainer.loggers import (
    METRICS_FILE,
    SAMPLES_FILE,
    StepRecords,
    build_loggers,
    read_metrics,
    scalars,
)

__all__ = ["METRICS_FILE", "SAMPLES_FILE", "MetricsLogger", "SectionTimer", "RayMetrics", "gauge_name",
           "read_metrics"]


class SectionTimer:
    """`with timer("generate"): ...` adds the seconds to `timing/generate` (and a span on the
    step timeline when the step is traced, rlhf.trace).

    The driver's clock: each phase ends when the workers' results are on the host (ray.get),
    so it is exact here. Device work inside a worker is timed with `rlhf.parallel.timing`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, section: str):
        start = time.perf_counter()
        try:
            with span(section):
                yield
        finally:
            key = f"timing/{section}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start


class MetricsLogger:
    """Sends each step's record to the configured loggers (`trainer.loggers`) and, optionally,
    to Ray gauges."""

    def __init__(self, output_dir: str | Path, *, total_steps: int, start_step: int,
                 job_name: str, loggers=("console", "jsonl"), config: dict | None = None,
                 ray_metrics: bool = False, progress: bool = True,
                 wandb_project: str = "rlhf", mlflow_tracking_uri: str | None = None):
        self._loggers = build_loggers(
            loggers, output_dir=output_dir, run_name=job_name, config=config or {},
            total_steps=total_steps, start_step=start_step, progress=progress,
            wandb_project=wandb_project, mlflow_tracking_uri=mlflow_tracking_uri)
        self._ray = RayMetrics(job_name) if ray_metrics else None
        self._samples = StepRecords(Path(output_dir) / SAMPLES_FILE, start_step=start_step)

    def log(self, step: int, metrics: dict[str, Any]) -> dict:
        """Write `metrics` of `step` everywhere; returns the record as written."""
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        for logger in self._loggers:
            logger.log(step, record)
        if self._ray is not None:
            self._ray.set(scalars(record))
        return record

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Write a sample table of `step` (rlhf.trainer.samples) to output_dir/samples.jsonl
        and to every logger that holds tables."""
        self._samples.write([{"step": step, **row} for row in rows])
        for logger in self._loggers:
            logger.log_table(step, rows)

    def close(self) -> None:
        self._samples.close()
        for logger in self._loggers:
            logger.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    value = float(value)
    return value if math.isfinite(value) else str(value)


def gauge_name(metric: str) -> str:
    """A Prometheus-safe name: 'actor/pg_loss' -> 'rlhf_actor_pg_loss'."""
    return "rlhf_" + re.sub(r"[^a-zA-Z0-9_]", "_", metric)


class _GaugeExporter:
    """Holds one ray.util.metrics.Gauge per metric name, tagged with the job."""

    def __init__(self, job_name: str):
        self.job_name, self.gauges = job_name, {}

    def set(self, values: dict[str, float]) -> list[str]:
        from ray.util.metrics import Gauge

        for key, value in values.items():
            name = gauge_name(key)
            if name not in self.gauges:
                self.gauges[name] = Gauge(name, description=f"rlhf metric {key}",
                                          tag_keys=("job",))
            self.gauges[name].set(value, tags={"job": self.job_name})
        return sorted(self.gauges)


class RayMetrics:
    """Exports metrics through Ray's metrics API from a small named actor `<job>/metrics`
    (an actor reports through its node's metrics agent, which the dashboard scrapes)."""

    def __init__(self, job_name: str):
        remote = ray.remote(num_cpus=0)(_GaugeExporter)
        self.actor = remote.options(name=f"{job_name}/metrics", get_if_exists=True).remote(job_name)
        self._pending = None

    def set(self, values: dict[str, float]) -> None:
        if self._pending is not None:  # at most one call in flight; never block a step
            ray.get(self._pending)
        self._pending = self.actor.set.remote(values)

    def exported(self) -> list[str]:
        """Gauge names created so far (waits for the last update)."""
        return ray.get(self.actor.set.remote({}))
