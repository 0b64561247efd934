"""`rlhf config show` and `rlhf config docs` through the CLI entry point."""

from pathlib import Path

import pytest

from rlhf.cli import main
from rlhf.config import config_from_dict, load_config, reference_markdown
from rlhf.config.loader import parse_yaml
from rlhf.config.paths import resolve_paths
from rlhf.demo.arithmetic_data import ArithTask, write_arith_dataset

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


@pytest.fixture
def quickstart_inputs(tmp_path, monkeypatch):
    """The quickstart's data files (small) in a fresh working directory; `config show` checks
    that they exist. Its models are built by `rlhf sft` and model.tiny, so they may be absent."""
    monkeypatch.chdir(tmp_path)
    for name, kind in (("train", "rl"), ("val", "rl"), ("sft_train", "sft")):
        write_arith_dataset(tmp_path / "outputs/quickstart/data" / f"{name}.jsonl",
                            task=ArithTask(), n=4, seed=0, kind=kind)
    return tmp_path


def test_config_show_prints_the_resolved_yaml(capsys, quickstart_inputs):
    assert main(["config", "show", str(QUICKSTART), "actor.optim.lr=2e-6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model:\n")
    cfg = config_from_dict(parse_yaml(out))
    assert cfg == resolve_paths(load_config(QUICKSTART, ["actor.optim.lr=2e-6"]),
                                base=quickstart_inputs)
    assert cfg.trainer.output_dir == str(quickstart_inputs / "outputs/quickstart/run")
    assert cfg.actor.optim.lr == 2e-6


def test_config_show_rejects_a_bad_config_without_traceback(capsys):
    assert main(["config", "show", str(QUICKSTART), "actor.optim.learning_rate=1e-6"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: unknown key 'actor.optim.learning_rate'")
    assert "Traceback" not in captured.err


def test_config_show_reports_a_missing_file(capsys, tmp_path):
    assert main(["config", "show", str(tmp_path / "absent.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "absent.yaml" in err and "Traceback" not in err


def test_config_docs_prints_the_reference(capsys):
    assert main(["config", "docs"]) == 0
    assert capsys.readouterr().out == reference_markdown()


def test_config_show_loads_the_reward_functions(capsys, tmp_path, quickstart_inputs):
    reward = tmp_path / "reward.py"
    reward.write_text("def score(*, prompt, response, ground_truth, extra):\n    return 1.0\n")
    assert main(["config", "show", str(QUICKSTART),
                 f"reward.functions=[{{path: '{reward}:score'}}]"]) == 0
    capsys.readouterr()
    assert main(["config", "show", str(QUICKSTART),
                 f"reward.functions=[{{path: '{reward}:scor'}}]"]) == 2
    err = capsys.readouterr().err
    assert "reward.functions[0].path" in err and "did you mean" in err and "Traceback" not in err
    missing = tmp_path / "absent.py"
    assert main(["config", "show", str(QUICKSTART),
                 f"reward.functions=[{{path: 'rlhf.rewards.arith:exact_match'}}, "
                 f"{{path: '{missing}:score'}}]"]) == 2
    assert "reward.functions[1].path" in capsys.readouterr().err
