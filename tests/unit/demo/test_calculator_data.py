"""The calculator example's data (rlhf.demo.calculator_data): problems, disjoint splits,
tool-use traces and `rlhf make-dataset calc`; and configs/calculator.yaml through `rlhf config show`."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from rlhf.cli import build_parser, main
from rlhf.config import load_config
from rlhf.demo.calculator_data import CalcTask, draw_problems, tool_call_text, write_calc_dataset
from rlhf.demo.tiny_tokenizer import train_tiny_tokenizer
from rlhf.envs.tools import CalculatorEnv, calculator, parse_tool_calls
from rlhf.errors import ConfigError, RLHFError

CALCULATOR = Path(__file__).resolve().parents[3] / "configs" / "calculator.yaml"
PROBLEM = re.compile(r"^(\d+)([-+*])(\d+)=$")


@pytest.fixture(scope="module")
def tok():
    return train_tiny_tokenizer(vocab_size=384, seed=0)


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_problems_have_the_digits_and_exact_answers():
    problems = draw_problems(CalcTask(), n=300, seed=3)
    assert problems == draw_problems(CalcTask(), n=300, seed=3)
    assert {p["op"] for p in problems} == {"+", "-", "*"}
    for p in problems:
        a, op, b = PROBLEM.match(p["prompt"]).groups()
        assert len(a) == 3 and len(b) == 2
        assert p["ground_truth"] == calculator(f"{a}{op}{b}") == str(eval(f"{a}{op}{b}"))
    wide = draw_problems(CalcTask(ops="*", digits=(4, 3)), n=20, seed=0)
    assert all(re.match(r"^\d{4}\*\d{3}=$", p["prompt"]) for p in wide)


def test_train_and_val_never_share_a_problem():
    train = {p["prompt"] for p in draw_problems(CalcTask(), n=2000, seed=0, split="train")}
    val = {p["prompt"] for p in draw_problems(CalcTask(), n=400, seed=5, split="val")}
    assert len(val) > 300 and not train & val


@pytest.mark.parametrize("kwargs", [{"ops": "/"}, {"ops": ""}, {"digits": (0, 2)},
                                    {"digits": (3,)}])
def test_bad_task_is_a_config_error(kwargs):
    with pytest.raises(ConfigError):
        CalcTask(**kwargs)


def split_trace(response: str, eos: str) -> tuple[str, str, str]:
    """(call turn, tool-result turn, answer) of a trace."""
    call, rest = response.split(eos, 1)
    observation, answer = rest.rsplit("\n", 1)
    return call, observation, answer


def test_sft_traces_call_the_right_expression_and_copy_the_result(tmp_path, tok):
    n = write_calc_dataset(tmp_path / "sft.jsonl", task=CalcTask(), n=50, seed=1, kind="sft",
                           split="train", tokenizer=tok)
    rows, rl = read(tmp_path / "sft.jsonl"), draw_problems(CalcTask(), n=50, seed=1,
                                                           split="train")
    assert n == 50 and [r["prompt"] for r in rows] == [p["prompt"] for p in rl]
    for row in rows:
        call, observation, answer = split_trace(row["response"], tok.eos_token)
        (parsed,) = parse_tool_calls(call)
        assert parsed.name == "calculator" and parsed.error is None
        assert parsed.arguments == {"expression": row["prompt"][:-1]}
        assert observation == f"<|user|>\n<tool_response>{answer}</tool_response>" \
            f"{tok.eos_token}<|assistant|>"
        assert answer == row["ground_truth"]
        env = CalculatorEnv()
        env.reset(prompt=row["prompt"], ground_truth=row["ground_truth"], extra={})
        assert env.step(text=call, token_ids=[]).observation[0]["content"] == answer
        assert env.step(text=answer, token_ids=[]).reward == 1.0


def test_format_traces_draw_the_operator_and_keep_the_operands(tmp_path, tok):
    write_calc_dataset(tmp_path / "f.jsonl", task=CalcTask(), n=300, seed=2, kind="format",
                       tokenizer=tok)
    rows, right = read(tmp_path / "f.jsonl"), 0
    for row in rows:
        call, _, answer = split_trace(row["response"], tok.eos_token)
        expression = parse_tool_calls(call)[0].arguments["expression"]
        a, op, b = PROBLEM.match(row["prompt"]).groups()
        assert re.match(rf"^{a}[-+*]{b}$", expression)
        assert answer == calculator(expression)  # the answer copies the tool's result
        right += answer == row["ground_truth"]
    assert 0.2 < right / len(rows) < 0.5  # the operator is right about a third of the time


def test_direct_and_rl_rows(tmp_path):
    write_calc_dataset(tmp_path / "d.jsonl", task=CalcTask(), n=5, seed=0, kind="direct")
    write_calc_dataset(tmp_path / "r.jsonl", task=CalcTask(), n=5, seed=0)
    direct, rl = read(tmp_path / "d.jsonl"), read(tmp_path / "r.jsonl")
    assert all(r["response"] == r["ground_truth"] for r in direct)
    assert all(set(r) == {"prompt", "ground_truth", "data_source"} for r in rl)
    with pytest.raises(ConfigError, match="--model"):  # a trace needs a chat template
        write_calc_dataset(tmp_path / "s.jsonl", task=CalcTask(), n=5, seed=0, kind="sft")
    with pytest.raises(RLHFError, match="already exists"):
        write_calc_dataset(tmp_path / "r.jsonl", task=CalcTask(), n=5, seed=0)


def test_cli_make_dataset_calc(tmp_path, capsys, tok):
    model = tmp_path / "model"
    tok.save_pretrained(model)
    path = tmp_path / "calc.jsonl"
    assert main(["make-dataset", "calc", str(path), "--n", "6", "--kind", "format",
                 "--ops", "*", "--digits", "4,2", "--model", str(model)]) == 0
    assert "wrote 6 format rows" in capsys.readouterr().out
    rows = read(path)
    assert all(re.match(r"^\d{4}\*\d{2}=$", r["prompt"]) for r in rows)
    assert all(tool_call_text(r["prompt"][:-1]) in r["response"] for r in rows)
    for bad in (["--kind", "sft"], ["--max-value", "9"], ["--digits", "3"],
                ["--digits", "a,b"], ["--ops", "/"]):
        assert main(["make-dataset", "calc", str(tmp_path / "x.jsonl"), "--n", "2", *bad]) == 2
        assert capsys.readouterr().err.startswith("error: ")
    assert main(["make-dataset", "arith", str(tmp_path / "y.jsonl"), "--n", "2",
                 "--digits", "3,2"]) == 2
    help_text = build_parser()._subparsers._group_actions[0].choices["make-dataset"].format_help()
    assert "calc" in help_text and "--digits" in help_text and "direct" in help_text


def test_shipped_calculator_config_shows_once_its_data_exists(tmp_path, monkeypatch, capsys):
    cfg = load_config(CALCULATOR)
    assert cfg.rollout.env.path == "rlhf.envs.tools:CalculatorEnv" and cfg.rollout.max_turns == 2
    assert cfg.reward.functions == () and cfg.algorithm.adv_estimator == "grpo"
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "outputs/calculator/data"
    for name in ("train", "val", "sft_train"):
        write_calc_dataset(data / f"{name}.jsonl", task=CalcTask(), n=4, seed=0, kind="direct")
    assert main(["config", "show", str(CALCULATOR)]) == 0
    assert "CalculatorEnv" in capsys.readouterr().out


def test_example_script_is_valid_bash_and_documented():
    repo = CALCULATOR.parents[1]
    result = subprocess.run(["bash", "-n", str(repo / "examples/calculator.sh")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    page = (repo / "docs/getting-started/calculator.md").read_text()
    assert "# Multi-turn example: the calculator tool" in page
    assert "bash examples/calculator.sh" in page and "`rlhf make-dataset calc" in page
    assert "bash examples/calculator.sh" in (repo / "README.md").read_text()
