"""`rlhf bench cost-model`: one JSON line with the prediction errors and both modes' step times."""

import json
import math

import rlhf.plan.profile as prof
from rlhf.bench.cost_model import lengths
from rlhf.cli import main
from rlhf.data.cost_model import CostModelFile, PhaseCost, RoleCost, StageCost
from tests.unit.plan.test_profile import QUICKSTART, TINY


def test_lengths_are_long_tailed_and_within_the_budget():
    drawn = lengths(400, median=32, sigma=1.0, most=256, seed=0)
    assert min(drawn) >= 4 and max(drawn) <= 256
    assert sorted(drawn)[200] < 48 and max(drawn) > 4 * sorted(drawn)[200]


def test_bench_prints_errors_and_step_times_of_both_modes(tmp_path, monkeypatch, capsys):
    # A made-up cost model in place of a profile (tests/unit/plan/test_profile.py runs one).
    stage = StageCost({"const": 1e-3, "tokens": 1e-5, "seqs": 1e-4}, {"tokens": 1e3})
    phases = {p: PhaseCost((stage,), {}) for p in ("forward", "forward_backward")}
    monkeypatch.setattr(prof, "profile", lambda cfg, **kw: (CostModelFile(
        {"actor": RoleCost({}, phases)}), tmp_path / "cost_model.json"))
    assert main(["bench", "cost-model", str(QUICKSTART), f"trainer.output_dir={tmp_path}",
                 f"model.path={tmp_path / 'absent'}", *TINY, "--samples", "6", "--batches", "1",
                 "--median", "16", "--repeats", "1"]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert line["bench"] == "cost-model" and line["pp"] == 1
    for key in ("micro_batch_median_abs_rel_error", "pass_p90_abs_rel_error",
                "step_median_abs_rel_error", "step_p90_abs_rel_error", "load_scale",
                "pass_median_abs_rel_error_at_load_scale",
                "step_s_token_budget", "step_s_cost_model", "speedup"):
        assert math.isfinite(line[key]) and line[key] >= 0, key
    assert line["passes_measured"] == 2 * line["dp"]  # one batch, both modes, every DP rank
    assert line["micro_batches_measured"] >= line["dp"]
    assert 0 <= line["token_budget_fallbacks"] <= line["batches"]
