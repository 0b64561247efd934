"""RewardRunner: weighted sums, metrics, errors, timeouts, crashes and result order with workers."""

import os
import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rlhf.config.schema import RewardConfig, RewardFunctionConfig
from rlhf.errors import RLHFError
from rlhf.rewards import RewardRunner, combine_scores
from rlhf.rewards.runner import function_names

FUNCTIONS = '''
import os
import time


def value(*, prompt, response, ground_truth, extra):
    """The response as a number; sleeps a little so workers finish out of order."""
    time.sleep(0.002 * (int(response) % 3))
    return float(response)


def match(*, prompt, response, ground_truth, extra):
    out = {"score": response == ground_truth, "length": len(response)}
    if extra.get("tag") is not None:
        out["tagged"] = 1.0  # reported by some samples only
    return out


def picky(*, prompt, response, ground_truth, extra):
    if response == "boom":
        raise ValueError(f"cannot score {response!r}")
    if response == "nan":
        return float("nan")
    if response == "text":
        return "yes"
    if response == "hang":
        time.sleep(60)
    if response == "die":
        os._exit(3)
    return 1.0


def slow(*, prompt, response, ground_truth, extra):
    time.sleep(0.08)
    return 1.0
'''


@pytest.fixture(scope="module")
def fns(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "fns.py"
    path.write_text(textwrap.dedent(FUNCTIONS))
    return lambda name: f"{path}:{name}"


@pytest.fixture(scope="module")
def picky_fallback(fns):
    with RewardRunner([(fns("picky"), 2.0)], num_workers=2, timeout_s=1.0, on_error="fallback",
                      fallback_score=-1.0) as runner:
        yield runner


@pytest.fixture(scope="module")
def picky_raise(fns):
    with RewardRunner([(fns("picky"), 1.0)], num_workers=2, timeout_s=1.0) as runner:
        yield runner


def score(runner, responses, truths=None, extras=None):
    n = len(responses)
    return runner.score(["p"] * n, responses, truths or ["t"] * n, extras)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_weighted_sum_and_metrics(fns, num_workers):
    with RewardRunner([(fns("value"), 2.0), (fns("match"), -0.5)],
                      num_workers=num_workers) as runner:
        result = score(runner, ["1", "2", "10"], ["1", "3", "10"],
                       [{"tag": "a"}, {}, {"tag": None}])
    assert result.scores.dtype == torch.float32
    assert result.scores.tolist() == [2 * 1 - 0.5, 2 * 2 - 0, 2 * 10 - 0.5]
    assert result.function_scores["value"].tolist() == [1.0, 2.0, 10.0]
    assert result.function_scores["match"].tolist() == [1.0, 0.0, 1.0]
    metrics = result.metrics
    assert metrics["reward/match/length"] == pytest.approx(4 / 3)
    assert metrics["reward/match/tagged"] == 1.0  # averaged over the one sample reporting it
    assert metrics["reward/value/score"] == pytest.approx(13 / 3)
    assert metrics["reward/match/errors"] == metrics["reward/match/timeouts"] == 0.0


def test_order_is_preserved_with_several_workers(fns):
    responses = [str((i * 7919) % 1000) for i in range(300)]
    with RewardRunner([(fns("value"), 1.0)], num_workers=3) as runner:
        for _ in range(2):  # the second batch reuses the warm workers
            result = score(runner, responses)
            assert result.scores.tolist() == [float(r) for r in responses]


def test_builtin_module_spec_runs_in_workers():
    with RewardRunner([("rlhf.rewards.arith:exact_match", 1.0)], num_workers=1) as runner:
        result = runner.score(["1+1="] * 3, ["2", "3", "two"], ["2"] * 3, None)
    assert result.scores.tolist() == [1.0, 0.0, 0.0]
    assert result.metrics["reward/exact_match/format_error"] == pytest.approx(1 / 3)


def test_raise_mode_names_function_sample_and_traceback(picky_raise):
    with pytest.raises(RLHFError) as info:
        score(picky_raise, ["ok", "ok", "boom", "ok"])
    message = str(info.value)
    assert "'picky'" in message and "sample 2" in message and "'boom'" in message
    assert "Traceback" in message and "ValueError: cannot score 'boom'" in message
    assert "on_error: fallback" in message and "rewards/worker.py" not in message
    assert score(picky_raise, ["ok"] * 5).scores.tolist() == [1.0] * 5


@pytest.mark.parametrize("response, shown", [("nan", "is nan"), ("text", "'yes' (str)")])
def test_bad_return_values(picky_raise, picky_fallback, response, shown):
    with pytest.raises(RLHFError, match=rf"'picky'.* sample 1 .*bad value.*{re.escape(shown)}"):
        score(picky_raise, ["ok", response, "ok"])
    result = score(picky_fallback, ["ok", response, "ok"])
    assert result.scores.tolist() == [2.0, -2.0, 2.0]
    assert result.function_scores["picky"].tolist() == [1.0, -1.0, 1.0]
    assert result.metrics["reward/picky/errors"] == 1.0


def test_fallback_mode_counts_errors(picky_fallback):
    result = score(picky_fallback, ["ok", "boom", "ok", "boom", "ok"])
    assert result.function_scores["picky"].tolist() == [1.0, -1.0, 1.0, -1.0, 1.0]
    assert result.metrics["reward/picky/errors"] == 2.0
    assert result.metrics["reward/picky/fallbacks"] == 2.0
    assert result.metrics["reward/picky/timeouts"] == 0.0


def test_hanging_call_times_out_and_the_pool_recovers(picky_fallback):
    start = time.monotonic()
    result = score(picky_fallback, ["ok"] * 6 + ["hang"] + ["ok"] * 6)
    assert time.monotonic() - start < 8
    assert result.function_scores["picky"].tolist() == [1.0] * 6 + [-1.0] + [1.0] * 6
    assert result.metrics["reward/picky/timeouts"] == 1.0
    assert result.metrics["reward/picky/errors"] == 0.0
    assert score(picky_fallback, ["ok"] * 8).scores.tolist() == [2.0] * 8


def test_the_timeout_is_per_call_not_per_chunk(fns):
    # One worker gets chunks of 6 calls (24 samples / 4 chunks): 0.48 s a chunk, 0.08 s a call.
    with RewardRunner([(fns("slow"), 1.0)], num_workers=1, timeout_s=0.4) as runner:
        assert score(runner, ["x"] * 24).scores.tolist() == [1.0] * 24


def test_hanging_call_raises_in_raise_mode(picky_raise):
    start = time.monotonic()
    with pytest.raises(RLHFError, match=r"'picky'.* sample 3 .*timeout_s=1s.*killed"):
        score(picky_raise, ["ok"] * 3 + ["hang"] + ["ok"] * 3)
    assert time.monotonic() - start < 8
    assert score(picky_raise, ["ok"] * 4).scores.tolist() == [1.0] * 4


def test_a_dying_worker_is_an_error_and_is_replaced(picky_fallback):
    result = score(picky_fallback, ["ok", "die", "ok", "ok"])
    assert result.function_scores["picky"].tolist() == [1.0, -1.0, 1.0, 1.0]
    assert result.metrics["reward/picky/errors"] == 1.0
    assert score(picky_fallback, ["ok"] * 3).scores.tolist() == [2.0] * 3


def test_in_process_mode_reports_errors_the_same_way(fns):
    with RewardRunner([(fns("picky"), 1.0)], num_workers=0, on_error="fallback") as runner:
        result = score(runner, ["ok", "boom", "nan"])
    assert result.scores.tolist() == [1.0, 0.0, 0.0]
    assert result.metrics["reward/picky/errors"] == 2.0


def test_close_stops_the_workers(fns):
    runner = RewardRunner([(fns("value"), 1.0)], num_workers=2)
    score(runner, ["1", "2"])
    procs = [worker.proc for worker in runner._processes._workers]
    runner.close()
    runner.close()
    assert all(proc.poll() is not None for proc in procs)
    with pytest.raises(RLHFError, match="closed"):
        score(runner, ["1"])


def test_bad_spec_fails_before_workers_start(fns):
    with pytest.raises(RLHFError, match="no attribute 'nope'"):
        RewardRunner([(fns("nope"), 1.0)], num_workers=2)


def test_mismatched_inputs_are_rejected(fns):
    with RewardRunner([(fns("value"), 1.0)], num_workers=0) as runner:
        with pytest.raises(ValueError, match="2 prompts, 1 responses"):
            runner.score(["p", "p"], ["1"], ["t", "t"])


def test_from_config(fns):
    cfg = RewardConfig(functions=(RewardFunctionConfig(path=fns("picky"), weight=3.0),),
                       num_workers=1, timeout_s=2.0, on_error="fallback", fallback_score=0.5)
    with RewardRunner.from_config(cfg) as runner:
        assert (runner.weights, runner.timeout_s, runner.on_error) == ([3.0], 2.0, "fallback")
        assert score(runner, ["ok", "boom"]).scores.tolist() == [3.0, 1.5]


def test_combine_scores_with_a_reward_model():
    a, b, rm = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([2.0, -2.0])
    assert combine_scores([a, b], [1.0, 2.0]).tolist() == [2.0, 1.0]
    assert combine_scores([a], [1.0], rm_scores=rm, rm_weight=0.5).tolist() == [2.0, -1.0]
    assert combine_scores([], [], rm_scores=rm).tolist() == [2.0, -2.0]
    with pytest.raises(ValueError, match="weights"):
        combine_scores([a, b], [1.0])
    with pytest.raises(ValueError, match="shapes"):
        combine_scores([a], [1.0], rm_scores=torch.zeros(3))
    with pytest.raises(ValueError, match="at least one"):
        combine_scores([], [])


def test_function_names_are_short_and_unique():
    assert function_names(["a.b:f", "c/d.py:g"]) == ["f", "g"]
    assert function_names(["a.b:f", "c/d.py:f"]) == ["b.f", "d.f"]
    assert function_names(["x/d.py:f", "y/d.py:f"]) == ["x/d.py:f", "y/d.py:f"]


def _worker_children() -> set[tuple[str, str]]:
    """(pid, start time) of this process's live reward workers: pids are recycled (pid_max
    32768 wraps within a suite), so a pid alone could name an earlier test's worker."""
    found = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "rlhf.rewards.worker"],
                           capture_output=True, text=True)
    alive = set()
    for pid in found.stdout.split():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # ended since pgrep saw it
        alive.add((pid, stat.rsplit(")", 1)[1].split()[19]))  # field 22: start time
    return alive


def _new_workers(before: set, expected: int, timeout_s: float = 5.0) -> set:
    """The live workers not in `before`, once there are `expected` of them (or after
    `timeout_s`): a worker spawned a moment ago can still be in exec, its command line not yet
    readable, and `pgrep -f` misses it (seen twice in loaded whole-suite runs)."""
    deadline = time.monotonic() + timeout_s
    while len(new := _worker_children() - before) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return new


def test_no_worker_process_outlives_close(fns):
    before = _worker_children()
    with RewardRunner([(fns("picky"), 1.0)], num_workers=2, timeout_s=0.5,
                      on_error="fallback") as runner:
        result = score(runner, ["ok", "hang", "die", "ok"])  # two workers replaced
        assert result.metrics["reward/picky/fallbacks"] == 2.0
        held = {w.proc.pid: w.proc.poll() for w in runner._processes._workers}
        assert len(_new_workers(before, 2)) == 2, f"runner's workers (pid: exit code) {held}"
    assert _worker_children() - before == set()


def test_an_empty_batch(fns):
    with RewardRunner([(fns("value"), 1.0)], num_workers=1) as runner:
        result = score(runner, [])
    assert result.scores.shape == (0,) and result.metrics["reward/value/errors"] == 0.0


def test_a_worker_that_cannot_load_the_function_is_reported(tmp_path):
    # Loads in the driver, fails in the worker (started with the driver's pid as its last
    # argument), like an import that depends on the process it runs in.
    path = tmp_path / "worker_only.py"
    path.write_text("import os, sys\nif sys.argv[-1] == str(os.getppid()):\n"
                    "    raise RuntimeError('not here')\ndef f(**kw):\n    return 1.0\n")
    with RewardRunner([(f"{path}:f", 1.0)], num_workers=1) as runner:
        with pytest.raises(RLHFError, match="(?s)could not load the reward functions.*"
                                            "RuntimeError: not here"):
            score(runner, ["1"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_no_functions_score_zero_for_a_reward_model_only_job(num_workers):
    with RewardRunner([], num_workers=num_workers) as runner:
        result = runner.score(["p"] * 3, ["a", "b", "c"], ["g"] * 3)
        assert runner._processes is None  # no worker processes for nothing to run
    assert torch.equal(result.scores, torch.zeros(3))
    assert result.function_scores == {} and result.metrics == {}
    rm = torch.tensor([0.5, -1.0, 2.0])
    total = combine_scores([result.scores], [1.0], rm_scores=rm, rm_weight=2.0)
    assert torch.equal(total, 2.0 * rm)
