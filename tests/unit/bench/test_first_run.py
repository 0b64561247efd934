"""The first-run report (rlhf.bench.first_run) on synthetic metric records: a healthy run passes,
each kind of finding is named with its step, the first in step order leads, and a metric the
run did not report is shown as such. The end-to-end run on CPU is tests/ray/test_first_run.py."""

import json
from pathlib import Path

import pytest
import torch

from rlhf.bench.first_run import FINDINGS, GIB, MEMORY_MARGIN, build_report, report_run
from rlhf.config import load_config
from rlhf.plan.memory import METHOD_PHASES, plan_job

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MULTIGPU = CONFIGS / "qwen2.5-7b_ppo_multigpu.yaml"


@pytest.fixture(scope="module")
def plan():
    """The shipped 7B job's plan (the architecture from configs/models)."""
    return plan_job(load_config(MULTIGPU), model_dirs=(CONFIGS / "models",))


def planned(plan, phase: str) -> float:
    return max(d.total(phase) for d in plan.devices if phase in d.phases) / GIB


def healthy(plan, steps=2) -> list[dict]:
    """Records as a healthy 7B run would log them: every phase 5% under its plan."""
    card = plan.hardware.device_bytes / GIB
    out = []
    for step in range(1, steps + 1):
        r = {"step": step, "sync/skipped": float(step == 1), "sync/receipts": 339.0,
             "sync/receipts_complete": 339.0, "rollout/logprob_gap_max": 0.6,
             "rollout/logprob_gap_mean": 0.01, "rollout/sleep_freed_gb": 30.1,
             "rollout/sleep_residual_gb": 2.2, "memory/nccl_communicators": 9.0,
             "memory/nccl_gb": 1.5, "memory/pinned_gb": 20.0, "timing/pin_s": 4.0,
             "timing/step": 100.0, "timing/generate": 40.0, "timing/sync_weights": 5.0}
        for method, phase in METHOD_PHASES.items():
            if any(phase in d.phases for d in plan.devices):
                r[f"memory/{method}/free_gb"] = card - 0.95 * planned(plan, phase)
                r[f"memory/{method}/allocated_gb"] = 0.5 * planned(plan, phase)
        out.append(r)
    return out


def report_of(records, plan, **kw):
    return build_report(records, total_steps=2, gap_limit=1.0, gap_dtype=torch.bfloat16,
                        plan=plan, **kw)


def test_a_healthy_run_passes_and_shows_every_section(plan):
    report = report_of(healthy(plan), plan)
    text = report.text()
    assert report.exit_code == 0
    assert text.rstrip().endswith("PASS: every step ran, every check held")
    assert "step 1: no sync" in text and "step 2: 339 of 339 modules complete" in text
    assert "step 2: max 0.6  mean 0.01" in text
    assert "update critic" in text and "sleep_freed_gb 30.1  sleep_residual_gb 2.2" in text
    assert "nccl_communicators 9  nccl_gb 1.5" in text and "pinned_gb 20  pin_s 4" in text
    assert "(plan: " in text  # NCCL and pinned memory stand beside the plan's figures
    assert "sync_weights" in text and "generate" in text


def test_a_residual_above_the_plans_is_named_with_the_value_to_feed_back(plan):
    """The plan counts rollout.sleep_residual_gb (3 GiB); a run that measures more says so."""
    report = report_of(healthy(plan), plan)
    assert "(plan: keeps 3.00 GiB, rollout.sleep_residual_gb=3)" in report.text()
    records = healthy(plan)
    records[1]["rollout/sleep_residual_gb"] = 4.2
    report = report_of(records, plan)
    (finding,) = report.findings
    assert finding.kind == "vllm residual over plan" and finding.step == 2
    assert "rollout.sleep_residual_gb=4.2" in finding.text and report.exit_code == 1
    assert "rollout.sleep_residual_gb=4.2" in report.text()


def test_a_run_that_stopped_shows_its_last_lines(plan):
    report = report_of(healthy(plan)[:1], plan, exit_code=1,
                       log_tail=["step 2 ...", "error: CUDA out of memory in update_actor"])
    (finding,) = report.findings
    assert finding.kind == "run failed" and finding.step == 2
    assert "1 of 2 steps logged" in finding.text
    assert "    error: CUDA out of memory in update_actor" in report.text()
    # a non-zero exit after every step also fails (the export after the last step, say)
    assert report_of(healthy(plan), plan, exit_code=1).findings[0].kind == "run failed"


def test_an_incomplete_receipt_is_named(plan):
    records = healthy(plan)
    records[1]["sync/receipts_complete"] = 337.0
    (finding,) = report_of(records, plan).findings
    assert (finding.kind, finding.step) == ("sync incomplete", 2)
    assert "2 of 339 modules" in finding.text
    records[1].pop("sync/receipts")
    records[1]["sync/receipts_complete"] = 0.0  # a flag, when the count is not reported
    assert report_of(records, plan).findings[0].kind == "sync incomplete"


def test_a_gap_over_the_limit_is_named_but_not_before_the_first_sync(plan):
    records = healthy(plan)
    records[0]["rollout/logprob_gap_p99"] = 5.0  # step 1: vLLM loaded the model itself
    assert report_of(records, plan).exit_code == 0
    records[1]["rollout/logprob_gap_max"] = 4.0  # the single worst token alone does not stop
    assert report_of(records, plan).exit_code == 0
    records[1]["rollout/logprob_gap_p99"] = 1.7
    (finding,) = report_of(records, plan).findings
    assert (finding.kind, finding.step) == ("gap over limit", 2)
    assert "1.7" in finding.text and "rollout.max_logprob_gap_p99" in finding.text
    assert build_report(records, total_steps=2, gap_limit=2.0, gap_dtype=torch.bfloat16,
                        plan=plan).exit_code == 0


def test_memory_over_the_plan_by_more_than_the_margin_is_named(plan):
    card = plan.hardware.device_bytes / GIB
    records = healthy(plan)
    over = planned(plan, "update critic") * (1 + MEMORY_MARGIN + 0.02)
    records[0]["memory/update_critic/free_gb"] = card - over
    (finding,) = report_of(records, plan).findings
    assert (finding.kind, finding.step) == ("memory over plan", 1)
    assert finding.text.startswith("update critic (update_critic) used")
    # within the margin: a note in the table, no finding
    records[0]["memory/update_critic/free_gb"] = card - planned(plan, "update critic") * 1.05
    assert report_of(records, plan).exit_code == 0
    # the card the run had, when known, replaces the plan's trainer.device_memory_gb
    assert report_of(healthy(plan), plan, device_gib=card + 10).findings[0].kind == \
        "memory over plan"


def test_nccl_memory_over_the_plan_is_named(plan):
    records = healthy(plan)
    records[1]["memory/nccl_gb"] = 40.0
    (finding,) = report_of(records, plan).findings
    assert (finding.kind, finding.step) == ("nccl over plan", 2)


def test_the_first_thing_that_went_wrong_leads(plan):
    records = healthy(plan)
    records[1]["rollout/logprob_gap_p99"] = 3.0
    records[1]["sync/receipts_complete"] = 300.0
    records[0]["memory/generate/free_gb"] = 0.0
    report = report_of(records, plan)
    verdict = report.text().split("\n\n")[-1].splitlines()
    assert verdict[0].startswith("FAIL: memory over plan (step 1): generate")
    assert verdict[1].startswith("  then: sync incomplete (step 2)")  # receipts before the gap
    assert verdict[2].startswith("  then: gap over limit (step 2)")
    assert {f.kind for f in report.findings} <= set(FINDINGS)


def test_missing_metrics_are_reported_as_such_never_an_error():
    records = [{"step": 1}, {"step": 2, "timing/step": 3.0}]
    report = build_report(records, total_steps=2, gap_limit=1.0, gap_dtype=torch.bfloat16,
                          plan=None,
                          plan_note="UnknownArchitecture: no config.json")
    text = report.text()
    assert report.exit_code == 0
    assert "step 2: not reported" in text and "(no plan: UnknownArchitecture" in text
    assert "not reported (vLLM on CPU does not sleep)" in text
    (row,) = [line.split() for line in text.splitlines() if line.startswith("  step  ")]
    assert row == ["step", "-", "3.00"]  # seconds per phase: step 1 reported none


def test_report_of_a_run_folder_and_its_command(tmp_path, capsys):
    from rlhf.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((CONFIGS / "first_run_cpu.yaml").read_text())
    records = [{"step": 1, "sync/skipped": 1.0, "rollout/logprob_gap_max": 1e-6,
                "memory/generate/host_rss_gb": 0.8, "timing/step": 5.0},
               {"step": 2, "sync/skipped": 0.0, "rollout/logprob_gap_p99": 2.5,
                "timing/step": 4.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "first_run.log").write_text("line 1\nerror: the last line\n")
    report = report_run(run)
    assert [f.kind for f in report.findings] == ["gap over limit"]
    assert "CPU: no device memory" in report.text() or "no plan:" in report.text()
    assert main(["run-report", str(run)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("FAIL: gap over limit (step 2)")
    assert (run / "first_run_report.txt").read_text() == out
    (run / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    report = report_run(run)  # step 2 never logged: the run failed, its log's last lines show
    assert report.findings[0].kind == "run failed" and "error: the last line" in report.text()
