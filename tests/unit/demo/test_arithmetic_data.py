"""Synthetic arithmetic problems: exact answers, reproducible files, and the CLI around them."""

import json

import pytest

from rlhf.cli import build_parser, main
from rlhf.demo.arithmetic_data import (
    ArithTask,
    generate_problems,
    problem_split,
    sample_text,
    write_arith_dataset,
)
from rlhf.errors import ConfigError, RLHFError


@pytest.mark.parametrize("task", [ArithTask(), ArithTask(ops="*", max_value=9, terms=3),
                                  ArithTask(ops="+-*", max_value=50, terms=6)])
def test_ground_truth_equals_python_eval(task):
    problems = generate_problems(task, n=300, seed=3)
    for p in problems:
        expr = p["prompt"].removesuffix("=")
        assert set(expr) <= set("0123456789+-*")
        assert p["ground_truth"] == str(eval(expr))  # noqa: S307 - digits and operators only
    assert any(p["ground_truth"].startswith("-") for p in problems) == ("-" in task.ops)


def test_default_prompts_are_short():
    from rlhf.demo.tiny_tokenizer import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(vocab_size=512, seed=0)
    for task in (ArithTask(), ArithTask(ops="+-*", max_value=99, terms=4)):
        for p in generate_problems(task, n=200, seed=0):
            assert len(tokenizer(p["prompt"])["input_ids"]) <= 24


def test_problems_are_reproducible_by_seed():
    task = ArithTask(ops="+-*")
    assert generate_problems(task, n=50, seed=7) == generate_problems(task, n=50, seed=7)
    assert generate_problems(task, n=50, seed=7) != generate_problems(task, n=50, seed=8)
    assert sample_text(task, n=5, seed=7) == [s for p in generate_problems(task, n=5, seed=7)
                                              for s in (p["prompt"], p["ground_truth"])]


@pytest.mark.parametrize("kwargs, field", [
    ({"ops": ""}, "ops"), ({"ops": "+/"}, "ops"), ({"max_value": 0}, "max_value"),
    ({"terms": 1}, "terms"), ({"terms": 7}, "terms"),
])
def test_invalid_task_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ArithTask(**kwargs)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_writes_rl_and_sft_rows(tmp_path):
    task = ArithTask()
    assert write_arith_dataset(tmp_path / "rl.jsonl", task=task, n=20, seed=1, kind="rl") == 20
    sft_path = tmp_path / "deep" / "sft.jsonl"  # parent folders are created
    assert write_arith_dataset(sft_path, task=task, n=20, seed=1, kind="sft") == 20
    rl, sft = _rows(tmp_path / "rl.jsonl"), _rows(sft_path)
    assert all(r.keys() == {"prompt", "ground_truth", "data_source"} for r in rl)
    assert all(r["data_source"] == "arith" for r in rl)
    assert [{k: r[k] for k in rl[0]} for r in sft] == rl
    assert all(r["response"] == r["ground_truth"] and int(r["response"]) == eval(r["prompt"][:-1])
               for r in sft)
    assert rl == [dict(p, data_source="arith") for p in generate_problems(task, n=20, seed=1)]


def test_refuses_to_overwrite_and_rejects_bad_arguments(tmp_path):
    out = tmp_path / "rl.jsonl"
    write_arith_dataset(out, task=ArithTask(), n=3, seed=0)
    with pytest.raises(RLHFError, match="--overwrite"):
        write_arith_dataset(out, task=ArithTask(), n=5, seed=0)
    assert len(_rows(out)) == 3
    assert write_arith_dataset(out, task=ArithTask(), n=5, seed=0, overwrite=True) == 5
    assert len(_rows(out)) == 5
    with pytest.raises(ConfigError, match="kind"):
        write_arith_dataset(tmp_path / "x.jsonl", task=ArithTask(), n=5, seed=0, kind="dpo")
    with pytest.raises(ConfigError, match="n must"):
        write_arith_dataset(tmp_path / "x.jsonl", task=ArithTask(), n=0, seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rl.jsonl"]  # no temporary files left


def test_cli_make_dataset(tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    assert main(["make-dataset", "arith", str(path), "--n", "10", "--seed", "1"]) == 0
    assert len(_rows(path)) == 10 and "wrote 10 rl rows" in capsys.readouterr().out
    assert main(["make-dataset", "arith", str(path), "--n", "10", "--seed", "1"]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["make-dataset", "arith", str(path), "--n", "4", "--kind", "sft", "--ops", "+-*",
                 "--terms", "3", "--overwrite"]) == 0
    assert all("response" in r for r in _rows(path))
    assert main(["make-dataset", "arith", str(tmp_path / "b.jsonl"), "--n", "4", "--ops", "/"]) == 2
    assert "ops" in capsys.readouterr().err


def test_cli_make_tiny_model(tmp_path, capsys):
    out = tmp_path / "model"
    args = ["make-tiny-model", str(out), "--layers", "1", "--hidden", "64", "--heads", "2",
            "--kv-heads", "1", "--intermediate", "64", "--vocab", "320", "--arch", "qwen2"]
    assert main(args) == 0
    assert "wrote qwen2 model" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert main(args) == 2
    assert "error:" in capsys.readouterr().err
    assert main(args + ["--overwrite", "--tie-embeddings"]) == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_train_and_val_splits_never_share_a_problem():
    task = ArithTask(max_value=30)
    train = generate_problems(task, n=400, seed=1, split="train")
    val = generate_problems(task, n=100, seed=2, split="val")
    train_prompts = {p["prompt"] for p in train}
    assert not train_prompts & {p["prompt"] for p in val}
    assert {problem_split(p["prompt"]) for p in train} == {"train"}
    # About one in five problems is held out.
    drawn = generate_problems(task, n=2000, seed=3)
    share = sum(problem_split(p["prompt"]) == "val" for p in drawn) / len(drawn)
    assert 0.15 < share < 0.25


def test_split_draws_only_its_own_problems_from_a_small_space():
    # Of the four problems a-b with a, b in {0, 1}, only "1-0=" hashes into val.
    task = ArithTask(ops="-", max_value=1)
    assert {p["prompt"] for p in generate_problems(task, n=20, seed=0, split="val")} == {"1-0="}
    train = {p["prompt"] for p in generate_problems(task, n=50, seed=0, split="train")}
    assert train == {"0-0=", "0-1=", "1-1="}
    with pytest.raises(ConfigError, match="split must be one of"):
        generate_problems(task, n=1, seed=0, split="test")


def _operands(prompt):
    return [int(x) for x in prompt.removeprefix("max(").removesuffix(")=").split(",")]


@pytest.mark.parametrize("terms", [2, 3])
def test_max_form_asks_for_the_largest_operand(terms):
    problems = generate_problems(ArithTask(form="max", max_value=99, terms=terms), n=300, seed=4)
    for p in problems:
        assert p["prompt"].startswith("max(") and p["prompt"].endswith(")=")
        operands = _operands(p["prompt"])
        assert len(operands) == terms and all(0 <= x <= 99 for x in operands)
        assert p["ground_truth"] == str(max(operands))
    assert len({p["prompt"] for p in problems}) > 250  # 100**terms pairs: few repeats


def test_max_form_splits_never_share_a_prompt():
    task = ArithTask(form="max", max_value=99)
    train = {p["prompt"] for p in generate_problems(task, n=2000, seed=0, split="train")}
    val = [p["prompt"] for p in generate_problems(task, n=200, seed=0, split="val")]
    assert not train & set(val)
    assert {problem_split(p) for p in val} == {"val"} and len(set(val)) > 190


def test_format_rows_imitate_a_random_operand_not_the_answer(tmp_path):
    task = ArithTask(form="max", max_value=99)
    rl_path, fmt_path = tmp_path / "rl.jsonl", tmp_path / "format.jsonl"
    write_arith_dataset(rl_path, task=task, n=400, seed=2, kind="rl", split="train")
    write_arith_dataset(fmt_path, task=task, n=400, seed=2, kind="format", split="train")
    rl, fmt = _rows(rl_path), _rows(fmt_path)
    assert [{k: r[k] for k in rl[0]} for r in fmt] == rl  # the same problems, in order
    assert all(int(r["response"]) in _operands(r["prompt"]) for r in fmt)
    # Right about as often as a coin flip (ties are right either way), so SFT on these rows
    # cannot teach which number is the larger.
    right = sum(r["response"] == r["ground_truth"] for r in fmt) / len(fmt)
    assert 0.4 < right < 0.6
    assert any(r["response"] != r["ground_truth"] for r in fmt)
    again = tmp_path / "again.jsonl"
    write_arith_dataset(again, task=task, n=400, seed=2, kind="format", split="train")
    assert _rows(again) == fmt


def test_format_kind_works_for_expressions(tmp_path):
    path = tmp_path / "format.jsonl"
    write_arith_dataset(path, task=ArithTask(ops="+-*", terms=3), n=50, seed=0, kind="format")
    for r in _rows(path):
        operands = [int(x) for x in r["prompt"][:-1].replace("*", "+").replace("-", "+").split("+")]
        assert int(r["response"]) in operands


def test_invalid_form_and_kind_are_named():
    with pytest.raises(ConfigError, match="form must be one of expr, max"):
        ArithTask(form="min")
    with pytest.raises(ConfigError, match="kind must be one of rl, sft, format"):
        write_arith_dataset("unused.jsonl", task=ArithTask(), n=1, seed=0, kind="dpo")


def test_cli_make_dataset_max_form_and_format_kind(tmp_path, capsys):
    path = tmp_path / "sft.jsonl"
    assert main(["make-dataset", "arith", str(path), "--n", "20", "--form", "max",
                 "--max-value", "99", "--kind", "format", "--split", "train"]) == 0
    assert "wrote 20 format rows" in capsys.readouterr().out
    rows = _rows(path)
    assert all(r["prompt"].startswith("max(") and int(r["response"]) in _operands(r["prompt"])
               for r in rows)
    # --ops means nothing to the max form: refused, not ignored
    assert main(["make-dataset", "arith", str(tmp_path / "b.jsonl"), "--n", "4", "--form", "max",
                 "--ops", "+-"]) == 2
    assert "--ops applies to --form expr only" in capsys.readouterr().err
    assert not (tmp_path / "b.jsonl").exists()
    with pytest.raises(SystemExit):  # argparse names the choices
        main(["make-dataset", "arith", str(tmp_path / "c.jsonl"), "--n", "4", "--form", "min"])
    assert "invalid choice: 'min'" in capsys.readouterr().err
    help_text = build_parser()._subparsers._group_actions[0].choices["make-dataset"].format_help()
    assert "--form {expr,max}" in help_text and "format:" in help_text
