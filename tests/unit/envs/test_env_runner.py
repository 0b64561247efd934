"""EnvRunner: environments in worker processes keep per-episode state, a slow call times out
and kills only its worker (whose other episodes are reported lost), errors name the cause."""

import time

import pytest

from rlhf.envs.runner import EnvRunner
from rlhf.errors import RLHFError
from tests.unit.envs.scripted_env import SPEC

pytestmark = pytest.mark.timeout(120)


def row(script, **extra):
    return {"prompt": "p", "ground_truth": 0, "extra": {"script": script, **extra}}


def turn():
    return {"text": "t", "token_ids": [1]}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_episodes_keep_their_state_and_errors_come_back_as_outcomes(num_workers):
    runner = EnvRunner(SPEC, {"bonus": 0.5}, num_workers=num_workers, timeout_s=20)
    try:
        scripts = {0: [{"reward": 1.0}, {"reward": 2.0, "done": True}],
                   1: [{"raise": "no such board"}], 2: [{"obs": "hi"}, {"obs": "again"}]}
        assert all(o == ("ok", None) for o in runner.reset(
            {i: row(s) for i, s in scripts.items()}).values())
        first = runner.step({i: turn() for i in scripts})
        assert first[0][1].reward == 1.5 and first[2][1].observation == "hi"
        assert first[1][0] == "error" and "ValueError: no such board" in first[1][1]
        second = runner.step({0: turn(), 2: turn()})
        assert second[0][1].done and second[0][1].reward == 2.5  # its second scripted turn
        assert second[2][1].observation == "again"
        assert runner.reset({5: row([], reset_raise=True)})[5][0] == "error"
    finally:
        runner.close()


def test_a_slow_call_times_out_and_loses_only_its_workers_episodes():
    runner = EnvRunner(SPEC, num_workers=2, timeout_s=1.0)
    try:
        # Episodes 0 and 2 live in worker 0, 1 and 3 in worker 1.
        runner.reset({0: row([{"sleep": 30}]), 1: row([{"obs": "a"}, {"obs": "b"}]),
                      2: row([{"obs": "c"}, {"obs": "d"}]), 3: row([{"exit": True}])})
        start = time.monotonic()
        out = runner.step({0: turn(), 1: turn(), 3: turn()})
        assert time.monotonic() - start < 10
        assert out[0][0] == "timeout" and "timeout_s=1" in out[0][1]
        assert out[1][1].observation == "a"
        assert out[3][0] == "error" and "died (exit code 3)" in out[3][1]
        later = runner.step({1: turn(), 2: turn()})
        assert later[2][0] == "error" and "lost" in later[2][1]  # its worker was killed
        assert later[1][0] == "error" and "lost" in later[1][1]  # so was episode 3's
        # Fresh workers serve new episodes.
        runner.reset({0: row([{"obs": "x"}]), 1: row([{"obs": "y"}])})
        again = runner.step({0: turn(), 1: turn()})
        assert again[0][1].observation == "x" and again[1][1].observation == "y"
    finally:
        runner.close()


def test_a_bad_spec_fails_before_any_process_starts(tmp_path):
    (tmp_path / "envs.py").write_text("def not_a_class():\n    pass\n")
    with pytest.raises(RLHFError, match="not a subclass of rlhf.envs.Env"):
        EnvRunner(f"{tmp_path / 'envs.py'}:not_a_class")
    with pytest.raises(RLHFError, match="environment .* has no attribute 'Nope'"):
        EnvRunner(f"{tmp_path / 'envs.py'}:Nope")


def test_preflight_names_the_config_key_of_a_bad_environment(tmp_path):
    import dataclasses

    from rlhf.config import JobConfig, RolloutConfig
    from rlhf.config.schema import EnvConfig
    from rlhf.preflight import _check_env_import

    def problems(path):
        rollout = RolloutConfig(env=EnvConfig(path=path))
        return _check_env_import(dataclasses.replace(JobConfig(), rollout=rollout))

    assert problems(SPEC) == []
    (tmp_path / "broken.py").write_text("raise ImportError('no board library')\n")
    (message,) = problems(f"{tmp_path / 'broken.py'}:Board")
    assert message.startswith("rollout.env.path: environment") and "no board library" in message
