"""MetricsLogger: one JSON object per step, resume truncation, TensorBoard error, gauge names."""

import json

import pytest

from rlhf.errors import RLHFError
from rlhf.trainer.metrics import MetricsLogger, SectionTimer, gauge_name, read_metrics


def test_records_are_json_lines_and_a_resume_drops_later_steps(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=4, start_step=0, job_name="t", progress=False)
    for step in (0, 1, 2, 3):
        log.log(step, {"reward/mean": float(step), "val/accuracy": 0.5} if step == 2
                else {"reward/mean": float(step)})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3]
    assert json.loads(lines[2]) == {"step": 2, "reward/mean": 2.0, "val/accuracy": 0.5}
    # a run resumed from the step-1 checkpoint rewrites steps 2 and 3
    log = MetricsLogger(tmp_path, total_steps=4, start_step=1, job_name="t", progress=True)
    log.log(2, {"reward/mean": 20.0})
    log.close()
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == \
        [(0, 0.0), (1, 1.0), (2, 20.0)]


def test_tensorboard_without_the_package_names_the_fix(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(RLHFError, match=r"pip install -e '\.\[tensorboard\]'"):
            MetricsLogger(tmp_path, total_steps=1, start_step=0, job_name="t",
                          loggers=("tensorboard",), progress=False)
    else:
        log = MetricsLogger(tmp_path, total_steps=1, start_step=0, job_name="t",
                            loggers=("tensorboard",), progress=False)
        log.log(1, {"reward/mean": 1.0})
        log.close()
        assert list((tmp_path / "tensorboard").iterdir())


def test_gauge_names_are_prometheus_safe_and_timer_adds_up():
    assert gauge_name("actor/pg_loss") == "rlhf_actor_pg_loss"
    assert gauge_name("throughput/tokens_per_s") == "rlhf_throughput_tokens_per_s"
    timer = SectionTimer()
    for _ in range(2):
        with timer("generate"):
            pass
    assert set(timer.seconds) == {"timing/generate"} and timer.seconds["timing/generate"] >= 0
