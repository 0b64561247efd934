"""examples/data/prepare_math_data.py: GSM8K and MATH files as downloaded become rows that
the dataset reader takes and the built-in scorers grade, in our layout and in verl's."""

import importlib.util
import json
from pathlib import Path

import pytest

from rlhf.data.dataset import read_rows
from rlhf.rewards.gsm8k import score as gsm8k_score
from rlhf.rewards.math import boxed

SCRIPT = Path(__file__).parents[3] / "examples" / "data" / "prepare_math_data.py"
GROUND_TRUTH_KEY = {"ours": "ground_truth", "verl": "reward_model.ground_truth"}


@pytest.fixture(scope="module")
def prepare():
    spec = importlib.util.spec_from_file_location("prepare_math_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gsm8k_file(folder: Path) -> Path:
    rows = [{"question": "Tom has 3 apples and buys 4. How many?",
             "answer": "He has 3 + 4 = <<3+4=7>>7.\n#### 7"},
            {"question": "A farm sells 1,200 eggs twice.", "answer": "2 * 1,200 = 2400\n#### 2,400"}]
    path = folder / "gsm8k_test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def math_folder(folder: Path) -> Path:
    """MATH's archive layout: one JSON file per problem under train/<subject>/."""
    problems = {"algebra/1.json": ("Solve $x+1=3$.", "So $x = \\boxed{2}$."),
                "geometry/7.json": ("Half of a unit square's area?",
                                    "It is $\\boxed{\\frac{1}{2}}$.")}
    for name, (problem, solution) in problems.items():
        path = folder / "train" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"problem": problem, "level": "Level 2", "type": "Algebra",
                                    "solution": solution}))
    return folder / "train"


@pytest.mark.parametrize("layout", ["ours", "verl"])
def test_gsm8k_rows_are_read_and_graded(prepare, tmp_path, layout, capsys):
    out = tmp_path / f"gsm8k_{layout}.parquet"
    assert prepare.main(["gsm8k", str(gsm8k_file(tmp_path)), str(out), "--format", layout]) == 0
    assert f"wrote 2 gsm8k rows ({layout} layout)" in capsys.readouterr().out
    rows = read_rows([out], ground_truth_key=GROUND_TRUTH_KEY[layout])
    assert [r.ground_truth for r in rows] == ["7", "2400"]
    assert rows[0].prompt[0]["content"].startswith("Tom has 3 apples")
    assert rows[0].data_source == "openai/gsm8k"
    if layout == "verl":
        assert rows[1].extra["extra_info"] == {
            "split": "gsm8k_test", "index": 1, "question": "A farm sells 1,200 eggs twice.",
            "answer": "2 * 1,200 = 2400\n#### 2,400"}
    right = gsm8k_score(prompt="", response="4 + 3 = 7 #### 7", ground_truth=rows[0].ground_truth,
                        extra={})
    wrong = gsm8k_score(prompt="", response="#### 2,401", ground_truth=rows[1].ground_truth,
                        extra={})
    assert right["score"] == 1.0 and wrong["score"] == 0.0


@pytest.mark.parametrize("layout", ["ours", "verl"])
def test_math_archive_rows_are_read_and_graded(prepare, tmp_path, layout):
    out = tmp_path / f"math_{layout}.jsonl"
    assert prepare.main(["math", str(math_folder(tmp_path)), str(out), "--format", layout]) == 0
    rows = read_rows([out], ground_truth_key=GROUND_TRUTH_KEY[layout])
    assert [r.ground_truth for r in rows] == ["2", "\\frac{1}{2}"]
    assert "\\boxed{}" in rows[0].prompt[0]["content"]
    assert boxed(prompt="", response="Thus \\boxed{0.5}.", ground_truth=rows[1].ground_truth,
                 extra={})["score"] == 1.0


def test_bad_inputs_name_the_row(prepare, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n"
                   + json.dumps({"problem": "p"}) + "\n")
    assert prepare.main(["gsm8k", str(bad), str(tmp_path / "o.jsonl")]) == 1
    assert f"{bad}:1: no '#### N' final answer" in capsys.readouterr().err
    assert prepare.main(["math", str(bad), str(tmp_path / "o.jsonl")]) == 1
    assert f"{bad}:1: no ['problem', 'solution'] field" in capsys.readouterr().err
    assert prepare.main(["gsm8k", str(gsm8k_file(tmp_path)), str(tmp_path / "o.csv")]) == 1
    assert "must end in .jsonl or .parquet" in capsys.readouterr().err
