"""`rlhf bench pipeline` runs both schedules and both batch layouts on a very small model."""

import pytest

pytestmark = pytest.mark.timeout(300)


def test_bench_pipeline_prints_bubbles_and_packing_figures(bench_lines):
    # In this process: its stages start from the suite's rank server (torch already imported)
    lines = bench_lines("pipeline", "--pp", "2", "--vpp", "2", "--micro-batches", "1,3",
                        "--layers", "4", "--hidden", "64", "--tokens", "128", "--samples", "12",
                        "--budget", "512", "--repeats", "1")
    bubbles = [x for x in lines if x["kind"] == "bubble"]
    assert [(b["schedule"], b["micro_batches"]) for b in bubbles] == [
        ("1f1b", 1), ("1f1b", 3), ("interleaved", 1), ("interleaved", 3)]
    theory = {(b["vpp"], b["micro_batches"]): b["bubble_theory"] for b in bubbles}
    assert theory == {(1, 1): 0.5, (1, 3): 0.25, (2, 1): round(1 / 3, 4), (2, 3): round(1 / 7, 4)}
    for b in bubbles:
        assert 0 <= b["bubble_measured_mean"] <= b["bubble_measured_max"] < 1
        assert b["step_s"] > 0
    one_f_one_b_m3 = bubbles[1]
    assert one_f_one_b_m3["peak_held_per_stage"] == [2, 1]  # at most pp - stage
    packed, padded = [x for x in lines if x["kind"] == "packing"]
    assert (packed["mode"], padded["mode"]) == ("packed-planned", "padded")
    assert packed["padding_fraction"] == 0 and packed["tokens_computed"] == packed["real_tokens"]
    assert padded["real_tokens"] == packed["real_tokens"]
    assert padded["tokens_computed"] > padded["real_tokens"] and padded["padding_fraction"] > 0
    assert packed["micro_batches"] == padded["micro_batches"]
