"""`rlhf bench experts` on the CPU at a tiny shape: our three paths (grouped GEMMs on stored
stacks, grouped GEMMs stacking a copy, the loop) agree with transformers' block, every
implementation is timed against the baseline, and the chosen path is the loop."""

import argparse

import pytest
import torch

from rlhf.bench import experts as bench_experts


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench_experts.add_arguments(parser)
    return parser.parse_args(["--experts", "8", "--top-k", "2", "--hidden", "64",
                              "--intermediate", "32", "--tokens", "48", "--repeats", "1",
                              "--device", "cpu", *argv])


def test_lines_agree_and_name_the_baseline():
    lines = bench_experts.bench(_args())
    agreement = [x for x in lines if x["kind"] == "agreement"]
    assert [x["implementation"] for x in agreement] == ["ours_grouped_stacked", "ours_grouped",
                                                        "ours_loop"]
    assert all(x["passed"] and max(x["relative_error"].values()) < 1e-5 for x in agreement)
    speed = {x["implementation"]: x for x in lines if x["kind"] == "speed"}
    assert {"ours_grouped_stacked", "ours_grouped", "ours_loop",
            "transformers_eager"} <= speed.keys()
    baseline = speed["ours_loop"]["baseline"]
    assert speed[baseline]["ratio"] == 1.0
    for line in speed.values():
        assert line["ms"] > 0 and line["ratio"] == pytest.approx(
            line["ms"] / line["baseline_ms"], rel=1e-2, abs=1e-3)
    assert [name for name, x in speed.items() if x["chosen"]] == ["ours_loop"]  # the CPU's


def test_a_wrong_block_fails_the_agreement():
    x = torch.randn(16, 8)

    def reference(x):
        return x, x, x

    def shifted(x):  # right grads, an output off by a tenth of its largest magnitude
        return x + 0.1 * x.abs().max(), x, x

    line = bench_experts._agreement(shifted, reference, x, torch.float32)
    assert not line["passed"] and line["relative_error"]["out"] == pytest.approx(0.1, rel=1e-5)


def test_an_unknown_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="--dtype float16"):
        bench_experts._dtype("float16", torch.device("cpu"))
