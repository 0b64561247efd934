"""What runs inside an environment worker process: the episodes pinned to it, by id.

Messages from the runner: (spec, kwargs) first, then lists of (episode, method, payload)
calls, None to stop. Answers: ("ready",) or ("load_error", text), then one (episode, outcome)
per call as soon as it returns, so the runner can time every call (see rlhf.envs.runner).
"""

from __future__ import annotations

from collections.abc import Callable

from rlhf.envs.base import BadStep, Env, check_step_result
from rlhf.errors import RLHFError
from rlhf.rewards.loader import load_object, user_traceback
from rlhf.rewards.worker import child_main

# An outcome is ("ok", value), ("error", text) or ("timeout", text).
Outcome = tuple


def load_env_class(spec: str) -> type[Env]:
    """The Env subclass named by spec ('pkg.module:Class' or 'path/to/file.py:Class')."""
    cls = load_object(spec, what="environment")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise RLHFError(f"environment {spec!r} is a {type(cls).__name__}, not a subclass of "
                        f"rlhf.envs.Env; define `class MyEnv(Env)` with reset and step")
    return cls


def call_env(cls: type[Env], kwargs: dict, envs: dict[int, Env], episode: int, method: str,
             payload: dict) -> Outcome:
    """One call on one episode's environment; never raises for the environment's errors."""
    try:
        if method == "end":
            envs.pop(episode, None)
            return ("ok", None)
        if method == "reset":
            envs[episode] = cls(**kwargs)
            envs[episode].reset(**payload)
            return ("ok", None)
        if episode not in envs:
            return ("error", "step before reset (no environment for this episode)")
        return ("ok", check_step_result(envs[episode].step(**payload)))
    except BadStep as e:
        return ("error", f"it returned a bad value: {e}")
    except Exception as e:
        return ("error", f"{method} raised:\n{user_traceback(e)}")


def _load(first: tuple) -> tuple:
    spec, kwargs = first
    return load_env_class(spec), kwargs, {}


def _answer(loaded: tuple, task: list, send: Callable) -> None:
    cls, kwargs, envs = loaded
    for episode, method, payload in task:
        send((episode, call_env(cls, kwargs, envs, episode, method, payload)))


def main() -> None:
    """Entry point of an environment worker, started by rlhf.envs.runner: load the class the
    runner names, then serve calls on the episodes pinned here until told to stop."""
    child_main(_load, _answer)
