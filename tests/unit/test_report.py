"""`rlhf report` on synthetic run folders: every section, escaped text, links into the
timeline, the slow rank named; a run that has only started still gets a page."""

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest

from rlhf import report
from rlhf.errors import RLHFError
from rlhf.report import SECTIONS, build_report
from rlhf.trace import ProcessSpans, write_trace

REPO = Path(__file__).resolve().parents[2]


def started_run(root: Path, total_steps: int = 2) -> Path:
    run = root / "run"
    run.mkdir()
    text = (REPO / "configs" / "quickstart.yaml").read_text()
    assert "  total_steps: 100\n" in text  # the trainer's
    (run / "config.yaml").write_text(text.replace("  total_steps: 100\n",
                                                  f"  total_steps: {total_steps}\n"))
    return run


@pytest.fixture(autouse=True)
def plan(monkeypatch):
    """A made-up plan: planning the quickstart imports transformers, seconds of a unit test."""
    monkeypatch.setattr(report, "_plan", lambda run: ({"update actor": 2.5}, ""))


def write_steps(run: Path) -> None:
    records = [{"step": s, "reward/mean": 0.1 * s, "timing/step": 2.0, "timing/generate": 1.5,
                "timing/update_actor": 0.4, "memory/update_actor/host_rss_gb": 1.25 + s,
                "note": "text"} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = [{"step": 2, "index": 3, "kind": "best", "prompt": "<script>alert(1)</script>",
             "response": "a very long answer\x1b", "reward": 0.9, "reward/length": 0.9,
             "length": 40, "truncated": True}]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    method = {"role_method": True}
    write_trace(run, 2, [
        ProcessSpans("driver", [("step", "", 0, 2_000_000, 1, {}),
                                ("generate", "", 10, 1_500_000, 1, {})]),
        ProcessSpans("actor:0", [("update_actor", "actor", 1_600_000, 300_000, 5, method),
                                 ("forward", "actor", 1_600_100, 100_000, 5, {"tokens": 9})]),
        ProcessSpans("actor:1", [("update_actor", "actor", 1_600_000, 400_000, 6, method)]),
    ])


def test_the_page_has_every_section_and_links_the_timeline(tmp_path):
    run = started_run(tmp_path)
    write_steps(run)
    page = build_report(run)
    for section in SECTIONS:
        assert f'<section id="{section}">' in page
    assert "step 2 of 2 (finished)" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # sample text is escaped
    assert "<script>alert" not in page
    assert "a very long answer\\x1b" in page and "\x1b" not in page  # controls made visible
    assert 'href="trace/step_000002.json"' in page and 'id="timeline-step-2"' in page
    assert 'href="#timeline-step-2"' in page  # the step's row links to its timeline
    # per role: the slowest rank named, the spread between ranks shown
    assert re.search(r"update_actor</td><td>2</td><td>0\.400 \(actor:1\)</td><td>0\.300</td>"
                     r"<td>25%</td>", page)
    # the worst host RSS of update_actor over the steps, beside the plan's update phase
    assert "<td>update_actor</td><td>update actor</td><td>2.500</td>" in page
    assert "<td>3.250</td>" in page
    assert 'data-name="reward/mean"' in page and 'data-name="note"' not in page
    # self-contained: nothing is fetched
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=", page)


def test_a_line_still_being_written_is_left_for_the_next_report(tmp_path):
    run = started_run(tmp_path)
    write_steps(run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/me')
    assert "step 2 of 2 (finished)" in build_report(run)
    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(RLHFError, match="line 2 is not JSON"):
        build_report(run)


def test_a_run_that_only_started_gets_a_page_saying_what_is_missing(tmp_path):
    run = started_run(tmp_path, total_steps=5)
    page = build_report(run)
    assert "step 0 of 5 (running or stopped)" in page
    assert "no metrics yet" in page and "no traced step yet" in page
    assert "no sample table yet" in page


def test_the_command_writes_the_page_and_refuses_a_folder_without_a_run(tmp_path, capsys):
    run = started_run(tmp_path)
    write_steps(run)
    # the command's body (building the whole `rlhf` parser imports torch: seconds)
    assert report._run(argparse.Namespace(output_dir=str(run), out=None)) == 0
    assert (run / "report.html").read_text().startswith("<!doctype html>")
    assert f"wrote {run / 'report.html'}" in capsys.readouterr().out
    shutil.rmtree(run / "trace")
    with pytest.raises(RLHFError, match="no config.yaml"):
        build_report(tmp_path)
