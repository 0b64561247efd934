"""The quiet console: noise stays in the log files, everything else still reaches the user."""

import logging

import pytest

from rlhf.logs import filter_worker_output, is_noise, setup_driver_logging

NOISE_LINE = "(ActorWorker pid=12) INFO 11-25 cpu.py:101] The global random seed is set to 0."
MISSED = "(ActorWorker pid=12) WARNING layerwise.py:266] QKVParallelLinear: Failed to load weights"


@pytest.fixture
def dispatcher():
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    saved = list(dispatcher.handlers)
    yield dispatcher
    dispatcher.handlers = saved


def test_worker_output_reaches_the_file_in_full_and_the_console_without_noise(dispatcher,
                                                                              tmp_path):
    shown = []
    dispatcher.handlers = [("ray_print_logs", shown.append)]
    filter_worker_output(tmp_path)
    filter_worker_output(tmp_path)  # a second call does not wrap twice
    lines = ["step 1 done", NOISE_LINE, "WARNING: the reward server is slow", MISSED]
    dispatcher.emit({"lines": lines, "pid": 12, "actor_name": "ActorWorker", "is_err": True})
    dispatcher.emit({"lines": [NOISE_LINE], "pid": 12, "actor_name": "ActorWorker",
                     "is_err": True})
    assert shown == [{"lines": [lines[0], lines[2], MISSED], "pid": 12,
                      "actor_name": "ActorWorker", "is_err": True}]
    logged = (tmp_path / "workers.log").read_text().splitlines()
    assert [line.split(") ", 1)[1] for line in logged] == lines + [NOISE_LINE]


def test_driver_logs_go_to_the_file_and_only_real_warnings_to_the_console(tmp_path, capsys):
    root = logging.getLogger()
    before = list(root.handlers), root.level
    try:
        path = setup_driver_logging(tmp_path / "logs")
        setup_driver_logging(tmp_path / "logs")  # again: handlers replaced, not doubled
        log = logging.getLogger("rlhf.test_logs")
        log.info("loaded 64 prompts")
        log.warning("reward model has no pad token")
        logging.getLogger("vllm.model_executor").warning("The global random seed is set to 0")
        logging.getLogger("vllm.model_executor").warning("QKVParallelLinear: Failed to load "
                                                         "weights")
        for handler in root.handlers:
            handler.flush()
    finally:
        for handler in root.handlers[:]:
            if handler not in before[0]:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(before[1])
    err = capsys.readouterr().err
    assert err.count("reward model has no pad token") == 1
    assert "loaded 64 prompts" not in err and "random seed" not in err
    assert "QKVParallelLinear: Failed to load weights" in err  # a sync that missed a module
    text = path.read_text()
    assert "loaded 64 prompts" in text and "reward model has no pad token" in text
    assert "Failed to load weights" in text and "random seed" in text


def test_noise_patterns_are_narrow():
    assert is_noise(NOISE_LINE)
    assert not is_noise(MISSED)
    assert not is_noise("Failed to load the reward function")  # ours, and real
    assert not is_noise("error: trainer.resume=x is not a checkpoint folder")
    assert is_noise("WARNING authentication_token_setup.py:85 -- Token authentication is "
                    "enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
    assert not is_noise("Token authentication failed: the cluster rejected this token")
