"""The span recorder, the clock-offset estimate and the Chrome trace it all becomes."""

import json
import threading

import pytest

from rlhf.trace import (
    ProcessSpans,
    SpanRecorder,
    chrome_trace,
    clock_offset,
    trace_path,
    write_trace,
)


def test_recorder_records_only_while_on_and_files_spans_under_the_running_role():
    rec = SpanRecorder()
    with rec.span("ignored"):
        pass
    assert rec.take() == []
    rec.on = True
    with rec.role_call("actor", "update_actor"):
        with rec.span("forward", micro_batch=0, tokens=12):
            pass
    with rec.span("outside"):
        pass
    spans = rec.take()
    assert [(s[0], s[1]) for s in spans] == [("forward", "actor"), ("update_actor", "actor"),
                                             ("outside", "")]
    forward, method, _ = spans
    assert forward[5] == {"micro_batch": 0, "tokens": 12}
    assert method[2] <= forward[2] and forward[2] + forward[3] <= method[2] + method[3]
    assert forward[4] == threading.get_native_id()
    assert rec.take() == []  # taken: the next step starts afresh


def test_a_failing_block_is_still_recorded_and_the_role_restored():
    rec = SpanRecorder()
    rec.on = True
    with pytest.raises(ValueError), rec.role_call("critic", "compute_values"):
        raise ValueError("boom")
    assert rec.role == ""
    assert [s[0] for s in rec.take()] == ["compute_values"]


def test_clock_offset_takes_the_shortest_round_trip():
    # remote clock 5000 us ahead; the slow ping (queued) would say 5000 + 400
    pings = [(0, 5000 + 1200, 2000), (3000, 8050, 3100), (4000, 9050, 4100)]
    offset, error = clock_offset(pings)
    assert offset == 8050 - 3050 == 5000
    assert error == 50
    with pytest.raises(ValueError, match="at least one ping"):
        clock_offset([])
    with pytest.raises(ValueError, match="came back before"):
        clock_offset([(10, 5, 3)])


def test_chrome_trace_moves_every_process_onto_the_driver_clock():
    driver = ProcessSpans("driver", [("generate", "", 1_000, 500, 7, {})])
    # the rank's clock runs 10 s ahead: its span began 100 us after the driver's
    rank = ProcessSpans("actor:0", [("generate", "actor", 10_001_100, 300, 9, {"tokens": 4})],
                        offset_us=10_000_000, error_us=20)
    trace = chrome_trace([driver, rank], step=3)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in spans] == [(0, 0, 500), (1, 100, 300)]
    assert spans[1]["args"] == {"tokens": 4, "role": "actor", "step": 3}
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    assert names == {0: "driver", 1: "actor:0"}
    assert trace["otherData"]["clocks"]["actor:0"] == {"offset_us": 10_000_000, "error_us": 20}


def test_write_trace_writes_a_step_file_that_json_reads(tmp_path):
    path = write_trace(tmp_path, 12, [ProcessSpans("driver", [("step", "", 5, 10, 1, {})])])
    assert path == trace_path(tmp_path, 12) == tmp_path / "trace" / "step_000012.json"
    assert json.loads(path.read_text())["otherData"]["step"] == 12
    assert not list(path.parent.glob("*.tmp"))
