"""Load a reward function from 'package.module:function' or 'path/to/file.py:function'.

`load_object` is the shared half: any named object (a reward function, an environment class)
by the same two forms, with errors that say what was being loaded."""

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from rlhf.config.paths import is_file_target
from rlhf.config.schema import REWARD_CONVENTIONS
from rlhf.errors import ConfigError, RLHFError
from rlhf.rewards.protocol import (
    EXPECTED_SIGNATURE,
    REWARD_KWARGS,
    VERL_KWARGS,
    VERL_SIGNATURE,
    VerlReward,
)


def _forms(what: str) -> str:
    name = "Class" if what == "environment" else "function"
    return f"'package.module:{name}' or 'path/to/file.py:{name}'"


def load_object(spec: str, *, what: str = "reward function") -> object:
    """The attribute named by spec ('package.module:name' or 'path/to/file.py:name'); errors
    start with `what` and spec. A file path is relative to the working directory."""
    target, sep, name = spec.rpartition(":")
    if not (sep and target and name):
        raise RLHFError(f"{what} {spec!r}: expected {_forms(what)}")
    module = (_load_file(spec, Path(target), what) if is_file_target(target)
              else _import_module(spec, target, what))
    if not hasattr(module, name):
        raise RLHFError(f"{what} {spec!r}: {target} has no attribute {name!r}"
                        f"{_close_names(module, name)}")
    return getattr(module, name)


def load_reward_function(spec: str, *, convention: str = "auto") -> Callable:
    """The callable named by spec, checked to accept the reward keyword arguments; a verl
    function (convention 'verl', or 'auto' and a `solution_str` parameter) comes wrapped in a
    VerlReward that takes them."""
    fn = load_object(spec, what="reward function")
    if not callable(fn):
        raise RLHFError(f"reward function {spec!r}: {spec.rpartition(':')[2]} is a "
                        f"{type(fn).__name__}, not a function; expected {EXPECTED_SIGNATURE}")
    if convention not in REWARD_CONVENTIONS:
        raise RLHFError(f"reward function {spec!r}: convention must be one of "
                        f"{', '.join(REWARD_CONVENTIONS)}, got {convention!r}")
    if convention == "verl" or (convention == "auto" and "solution_str" in _keyword_names(fn)):
        return VerlReward(fn, check_verl_signature(fn, spec))
    check_signature(fn, spec)
    return fn


def check_reward_functions(specs: list[str], *, timeout_s: float = 60.0,
                           conventions: list[str] | None = None) -> None:
    """Import every reward function in a child process that may take `timeout_s` seconds, so
    an import that raises, exits or hangs is reported by name before any worker starts.

    Raises ConfigError naming the config key (reward.functions[i].path) of each bad entry.
    """
    if not specs:
        return
    conventions = conventions or ["auto"] * len(specs)
    code = ("import sys, json; from rlhf.rewards.loader import _check_in_child; "
            "_check_in_child(*json.loads(sys.argv[1]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps([specs, conventions])],
                              capture_output=True, env=env, timeout=timeout_s)
        stdout, stderr, exit_code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        stdout, stderr, exit_code = e.stdout or b"", e.stderr or b"", None
    problems = _child_problems(specs, _decode(stdout), _decode(stderr), exit_code, timeout_s)
    if problems:
        raise ConfigError("\n".join(problems))


_MARK = "@@rlhf-reward-import@@ "


def _check_in_child(specs: list[str], conventions: list[str]) -> None:
    """The child's side of check_reward_functions: one marked JSON line per event on stdout."""
    def say(**event) -> None:
        print(_MARK + json.dumps(event), flush=True)

    for i, (spec, convention) in enumerate(zip(specs, conventions)):
        say(start=i)
        try:
            load_reward_function(spec, convention=convention)
        except RLHFError as e:
            say(error=i, message=str(e))
    say(done=True)


def _child_problems(specs: list[str], stdout: str, stderr: str, exit_code: int | None,
                    timeout_s: float) -> list[str]:
    events = [json.loads(line[len(_MARK):]) for line in stdout.splitlines()
              if line.startswith(_MARK)]
    problems = [f"reward.functions[{e['error']}].path: {e['message']}"
                for e in events if "error" in e]
    if any(e.get("done") for e in events):
        return problems
    started = [e["start"] for e in events if "start" in e]
    where = (f"reward.functions[{started[-1]}].path: reward function {specs[started[-1]]!r}"
             if started else "the reward functions' import check")
    tail = stderr.strip().splitlines()[-5:]
    shown = ("; its last output:\n" + "\n".join(tail)) if tail else ""
    if exit_code is None:
        problems.append(f"{where}: importing it did not finish within {timeout_s:g} s (does "
                        f"the module block or loop at import?); move slow work into the "
                        f"function or raise reward.import_timeout_s")
    else:
        problems.append(f"{where}: importing it ended the process (exit code {exit_code}, e.g. "
                        f"sys.exit or os._exit at import){shown}; remove that from the module's "
                        f"top level")
    return problems


def _decode(data: bytes | str) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def user_traceback(exc: BaseException) -> str:
    """The traceback of exc without the frames of importlib and of rlhf.rewards' own machinery."""
    ours = (__file__, importlib.__file__, str(Path(__file__).with_name("worker.py")))
    report = traceback.TracebackException.from_exception(exc)
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack
         if not frame.filename.startswith("<frozen") and frame.filename not in ours])
    return "".join(report.format()).rstrip()


def _import_module(spec: str, target: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise RLHFError(
                f"{what} {spec!r}: module {target!r} not found ({e}); install it, put "
                f"its folder on PYTHONPATH, or give a file path such as "
                f"'path/to/{target.rsplit('.', 1)[-1]}.py:name'") from None
        raise RLHFError(f"{what} {spec!r}: importing {target!r} failed because it "
                        f"imports a missing module:\n{user_traceback(e)}") from None
    except Exception as e:  # user code runs at import; show what went wrong in it
        raise RLHFError(f"{what} {spec!r}: importing {target!r} failed:\n"
                        f"{user_traceback(e)}") from None


def _load_file(spec: str, path: Path, what: str) -> ModuleType:
    if path.suffix != ".py":
        raise RLHFError(f"{what} {spec!r}: {str(path)!r} is not a .py file; "
                        f"expected {_forms(what)}")
    if not path.is_file():
        raise RLHFError(f"{what} {spec!r}: file {str(path)!r} does not exist "
                        f"(relative paths start at the working directory {str(Path.cwd())!r})")
    resolved = path.resolve()
    # A name of its own per file, so user files called e.g. "reward.py" never collide with
    # each other or with installed modules; registered so pickling and dataclasses work.
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    module_name = f"_rlhf_reward_file_{resolved.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[module_name]
        if not isinstance(e, Exception):
            raise
        raise RLHFError(f"{what} {spec!r}: running {str(path)!r} failed:\n"
                        f"{user_traceback(e)}") from None
    return module


def _close_names(module: ModuleType, name: str) -> str:
    candidates = [n for n, v in vars(module).items()
                  if callable(v) and not n.startswith("_") and not inspect.isclass(v)]
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
    if close:
        return f"; did you mean {', '.join(close)}?"
    if candidates:
        return f"; its functions are {', '.join(sorted(candidates)[:10])}"
    return "; it defines no public functions"


def _keyword_names(fn: Callable) -> set[str]:
    """Parameters fn takes by keyword; empty when it has no signature to read."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_verl_signature(fn: Callable, spec: str) -> tuple[str, ...]:
    """The verl arguments to pass fn (those it names, or all four to **kwargs); RLHFError when
    it needs an argument verl never passes or takes none of verl's by keyword."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return VERL_KWARGS
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return VERL_KWARGS
    names = tuple(k for k in VERL_KWARGS if k in _keyword_names(fn))
    required_extra = [p.name for p in params if p.default is p.empty and p.name not in names
                      and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if required_extra or "solution_str" not in names:
        problem = (f"requires {', '.join(required_extra)}, which verl never passes"
                   if required_extra else "does not take solution_str by keyword")
        raise RLHFError(f"reward function {spec!r} (verl convention) has signature "
                        f"{inspect.signature(fn)} and {problem}; expected {VERL_SIGNATURE}")
    return names


def check_signature(fn: Callable, spec: str) -> None:
    """Raise RLHFError unless fn can be called as fn(prompt=, response=, ground_truth=, extra=)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins and C callables have no signature to check: trust them
    params = signature.parameters.values()
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    by_keyword = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [k for k in REWARD_KWARGS if k not in by_keyword and not takes_kwargs]
    required_extra = [p.name for p in params if p.default is p.empty and p.name not in
                      REWARD_KWARGS and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if missing or required_extra:
        problems = []
        if missing:
            problems.append(f"does not accept {', '.join(missing)} as keyword arguments")
        if required_extra:
            problems.append(f"requires {', '.join(required_extra)}, which is never passed")
        raise RLHFError(f"reward function {spec!r} has signature {signature} and "
                        f"{' and '.join(problems)}; expected {EXPECTED_SIGNATURE} "
                        f"(a trailing **kwargs also accepts them), or verl's "
                        f"{VERL_SIGNATURE}")
