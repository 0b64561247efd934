"""Loading reward functions from module and file specs, and every way a spec can be wrong."""

import textwrap

import pytest

import rlhf.rewards.arith
from rlhf.errors import RLHFError
from rlhf.rewards import EXPECTED_SIGNATURE, load_reward_function

GOOD = "def {name}(*, prompt, response, ground_truth, extra):\n    return {value}\n"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def call(fn, response="r"):
    return fn(prompt="p", response=response, ground_truth="g", extra={})


def test_module_spec_returns_the_function():
    fn = load_reward_function("rlhf.rewards.arith:exact_match")
    assert fn is rlhf.rewards.arith.exact_match


def test_file_spec_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path / "rewards" / "mine.py", GOOD.format(name="f", value="0.25"))
    monkeypatch.chdir(tmp_path)
    assert call(load_reward_function("rewards/mine.py:f")) == 0.25
    assert call(load_reward_function("./rewards/mine.py:f")) == 0.25


def test_files_with_one_name_in_two_folders_stay_apart(tmp_path):
    a = write(tmp_path / "a" / "reward.py", GOOD.format(name="f", value="1.0"))
    b = write(tmp_path / "b" / "reward.py", GOOD.format(name="f", value="2.0"))
    fa, fb = load_reward_function(f"{a}:f"), load_reward_function(f"{b}:f")
    assert (call(fa), call(fb)) == (1.0, 2.0)
    assert fa.__module__ != fb.__module__


def test_file_module_supports_dataclasses_and_kwargs_functions(tmp_path):
    path = write(tmp_path / "dc.py", """
        from dataclasses import dataclass

        @dataclass
        class Answer:
            value: int

        def f(**kwargs):
            return float(Answer(int(kwargs["response"])).value)
    """)
    assert call(load_reward_function(f"{path}:f"), response="7") == 7.0


def load_error(spec):
    with pytest.raises(RLHFError) as info:
        load_reward_function(spec)
    message = str(info.value)
    assert spec in message
    return message


@pytest.mark.parametrize("spec", ["no_colon", "module:", ":function"])
def test_malformed_spec(spec):
    assert "package.module:function" in load_error(spec)


def test_module_not_found_shows_the_import_error():
    message = load_error("no_such_package_xyz.rewards:f")
    assert "not found" in message and "No module named 'no_such_package_xyz'" in message


def test_module_importing_a_missing_dependency(tmp_path, monkeypatch):
    write(tmp_path / "needs_dep.py", "import missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = load_error("needs_dep:f")
    assert "imports a missing module" in message and "missing_dependency_xyz" in message


def test_module_raising_at_import_shows_its_traceback(tmp_path, monkeypatch):
    write(tmp_path / "boom_mod.py", "raise RuntimeError('exploded at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = load_error("boom_mod:f")
    assert "RuntimeError: exploded at import" in message and "Traceback" in message


def test_file_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = load_error("nowhere/reward.py:f")
    assert "does not exist" in message and str(tmp_path) in message


def test_file_that_is_not_python(tmp_path):
    path = write(tmp_path / "reward.txt", "x")
    assert "not a .py file" in load_error(f"{path}:f")


def test_file_with_a_syntax_error(tmp_path):
    path = write(tmp_path / "broken.py", "def f(:\n")
    assert "SyntaxError" in load_error(f"{path}:f")


def test_missing_attribute_suggests_close_names():
    message = load_error("rlhf.rewards.arith:exact_matc")
    assert "no attribute 'exact_matc'" in message and "did you mean exact_match" in message


def test_missing_attribute_lists_the_functions(tmp_path):
    path = write(tmp_path / "two.py", GOOD.format(name="alpha", value="1") +
                 GOOD.format(name="beta", value="2"))
    message = load_error(f"{path}:zzz")
    assert "its functions are alpha, beta" in message


def test_not_callable(tmp_path):
    path = write(tmp_path / "const.py", "score = 3\n")
    message = load_error(f"{path}:score")
    assert "is a int, not a function" in message and EXPECTED_SIGNATURE in message


@pytest.mark.parametrize("signature, problem", [
    ("(response, ground_truth)", "does not accept prompt, extra"),
    ("(prompt, response, ground_truth, extra, /)", "does not accept prompt, response"),
    ("(*, prompt, response, ground_truth, extra, scale)", "requires scale"),
    ("(text, ground_truth, **kwargs)", "requires text"),
])
def test_wrong_signature_explains_the_expected_one(tmp_path, signature, problem):
    path = write(tmp_path / "sig.py", f"def f{signature}:\n    return 1.0\n")
    message = load_error(f"{path}:f")
    assert problem in message and EXPECTED_SIGNATURE in message
    assert signature.split(",")[0] in message  # the function's actual signature is shown


def test_signatures_that_are_accepted(tmp_path):
    path = write(tmp_path / "ok.py", """
        def positional(prompt, response, ground_truth, extra, scale=2.0):
            return scale
        def star_args(*args, prompt, response, ground_truth, extra):
            return 1.0
        class Scorer:
            def __call__(self, **kw):
                return 3.0
        instance = Scorer()
    """)
    assert call(load_reward_function(f"{path}:positional")) == 2.0
    assert call(load_reward_function(f"{path}:star_args")) == 1.0
    assert call(load_reward_function(f"{path}:instance")) == 3.0


# ---- the import check runs in a child process with a time limit ------------------------------

def test_import_check_reports_a_module_that_exits_by_name(tmp_path):
    from rlhf.errors import ConfigError
    from rlhf.rewards import check_reward_functions

    good = write(tmp_path / "good.py", GOOD.format(name="f", value="1.0"))
    exits = write(tmp_path / "exits.py", "import sys\nprint('bye')\nsys.exit(0)\n")
    hard = write(tmp_path / "hard.py",
                 "import os, sys\nsys.stderr.write('dying\\n')\nos._exit(3)\n")
    check_reward_functions([f"{good}:f", "rlhf.rewards.arith:exact_match"])
    with pytest.raises(ConfigError) as info:
        check_reward_functions([f"{good}:f", f"{exits}:f"])
    assert str(info.value) == (f"reward.functions[1].path: reward function '{exits}:f': "
                               "importing it ended the process (exit code 0, e.g. sys.exit or "
                               "os._exit at import); remove that from the module's top level")
    with pytest.raises(ConfigError,
                       match=r"(?s)^reward.functions\[0\].path: .*exit code 3.*dying"):
        check_reward_functions([f"{hard}:f", f"{good}:f"])


def test_import_check_gives_up_on_a_module_that_hangs(tmp_path):
    from rlhf.errors import ConfigError
    from rlhf.rewards import check_reward_functions

    hangs = write(tmp_path / "hangs.py", "while True:\n    pass\n")
    good = write(tmp_path / "good.py", GOOD.format(name="f", value="1.0"))
    with pytest.raises(ConfigError, match=r"^reward.functions\[1\].path: reward function "
                                          r"'.*hangs.py:f': importing it did not finish within "
                                          r"2 s .*raise reward.import_timeout_s$"):
        check_reward_functions([f"{good}:f", f"{hangs}:f"], timeout_s=2)


def test_import_check_lists_each_bad_function_and_its_reason(tmp_path):
    from rlhf.errors import ConfigError
    from rlhf.rewards import check_reward_functions

    raises = write(tmp_path / "raises.py", "raise KeyError('judge url')\n")
    good = write(tmp_path / "good.py", GOOD.format(name="f", value="1.0"))
    with pytest.raises(ConfigError) as info:
        check_reward_functions([f"{raises}:f", f"{good}:g", f"{good}:f"])
    lines = str(info.value).split("\n")
    assert lines[0].startswith(f"reward.functions[0].path: reward function '{raises}:f': "
                               "running")
    assert any("KeyError: 'judge url'" in line for line in lines)
    assert lines[-1].startswith("reward.functions[1].path: ")
    assert lines[-1].endswith("its functions are f")
