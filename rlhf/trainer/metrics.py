"""Step metrics: OUTPUT_DIR/metrics.jsonl, a console progress bar, TensorBoard, Ray gauges."""

from __future__ import annotations

import json
import math
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

from rlhf.errors import RLHFError

METRICS_FILE = "metrics.jsonl"
# Shown on the progress bar, in this order, when present: (metric, short label). KL to the
# reference (actor/kl_ref) and policy-vs-old KL of the update (actor/approx_kl) are different
# quantities with different labels.
_BAR_KEYS = (("reward/mean", "reward"), ("val/accuracy", "val_acc"), ("actor/pg_loss", "pg"),
             ("actor/kl_ref", "kl_ref"), ("actor/approx_kl", "approx_kl"),
             ("critic/value_loss", "vf"), ("response_length/mean", "len"),
             ("throughput/tokens_per_s", "tok/s"), ("sft/nll", "nll"))


class PhaseTimer:
    """`with timer("generate"): ...` adds the seconds to `timing/generate`.

    The driver's clock: each phase ends when the workers' results are on the host (ray.get),
    so it is exact here. Device work inside a worker is timed with `rlhf.parallel.timing`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{phase}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start


def read_metrics(output_dir: str | Path) -> list[dict]:
    """Every record of OUTPUT_DIR/metrics.jsonl, in order ([] when there is none)."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


class MetricsLogger:
    """Appends one JSON object per logged step; on resume, records after `start_step` (left by
    a run that stopped after its last checkpoint) are dropped so the file matches the state."""

    def __init__(self, output_dir: str | Path, *, total_steps: int, start_step: int,
                 job_name: str, tensorboard: bool = False, ray_metrics: bool = False,
                 progress: bool = True):
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(output_dir) if r.get("step", 0) <= start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = _tensorboard_writer(Path(output_dir) / "tensorboard") if tensorboard else None
        self._ray = RayMetrics(job_name) if ray_metrics else None
        self._bar = (tqdm(total=total_steps, initial=start_step, desc=job_name, unit="step",
                          dynamic_ncols=True, mininterval=1.0) if progress else None)

    def log(self, step: int, metrics: dict[str, Any]) -> dict:
        """Write `metrics` of `step` everywhere; returns the record as written."""
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in record.items() if isinstance(v, float) and k != "step"}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._ray is not None:
            self._ray.set(numbers)
        if self._bar is not None:
            shown = {label: f"{record[k]:.4g}" for k, label in _BAR_KEYS if k in record}
            self._bar.set_postfix(shown, refresh=False)
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            if "val/accuracy" in record:
                self._bar.write(f"step {step}: val/accuracy={record['val/accuracy']:.4f}")
        return record

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    value = float(value)
    return value if math.isfinite(value) else str(value)


def _tensorboard_writer(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RLHFError(f"trainer.tensorboard is true but TensorBoard cannot be imported ({e}); "
                        "install it (`.venv/bin/pip install tensorboard`) or set "
                        "trainer.tensorboard=false") from None
    return SummaryWriter(log_dir=str(folder))


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
