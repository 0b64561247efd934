"""trainer.loggers: each tracker gets the run's config, every step's numbers and the sample
tables; a missing package names its extra; a resumed job continues the same tracked run."""

import json

import pytest

from rlhf.config import TrainerConfig
from rlhf.config.loader import build
from rlhf.errors import ConfigError, RLHFError
from rlhf.trainer import loggers as loggers_module
from rlhf.trainer.metrics import MetricsLogger

CONFIG = {"actor": {"optim": {"lr": 1e-6}}, "trainer": {"loggers": ["console", "mlflow"]}}


def _run(tmp_path, names, *, start_step=0, steps=(1, 2), **kwargs):
    log = MetricsLogger(tmp_path, total_steps=2, start_step=start_step, job_name="job",
                        loggers=names, config=CONFIG, progress=False, **kwargs)
    for step in steps:
        log.log_samples(step, [{"prompt": f"p{step}", "response": "r|1\n", "reward": 1.0}])
        log.log(step, {"reward/mean": 0.25 * step, "timing/step": 1.5, "note": "text"})
    log.close()


def test_console_without_a_bar_prints_validation_lines(tmp_path, capsys):
    log = MetricsLogger(tmp_path, total_steps=2, start_step=0, job_name="job",
                        loggers=("console",), progress=False)
    log.log(1, {"reward/mean": 0.5})
    log.log(2, {"val/accuracy": 0.75})
    log.close()
    assert capsys.readouterr().out == "step 2: val/accuracy=0.7500\n"
    assert not (tmp_path / "metrics.jsonl").exists()  # jsonl was not asked for


def test_mlflow_local_store_gets_params_and_every_step_and_resumes_the_run(tmp_path):
    from mlflow.tracking import MlflowClient

    _run(tmp_path, ("jsonl", "mlflow"))
    _run(tmp_path, ("jsonl", "mlflow"), start_step=2, steps=(3,))  # a resumed job
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("job").experiment_id])
    assert run.data.params["actor.optim.lr"] == "1e-06"
    assert run.data.params["trainer.loggers"] == '["console", "mlflow"]'
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert run.info.status == "FINISHED"
    assert [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").open())] == [1, 2, 3]
    artifact = client.download_artifacts(run.info.run_id, "samples/step_000003.json", tmp_path)
    assert json.loads(open(artifact).read()) == [{"prompt": "p3", "response": "r|1\n",
                                                  "reward": 1.0}]
    # every run keeps its tables in samples.jsonl too; the resume kept steps 1-2 once
    assert [(r["step"], r["prompt"]) for r in loggers_module.read_samples(tmp_path)] == [
        (1, "p1"), (2, "p2"), (3, "p3")]


def test_wandb_offline_run_holds_the_config_and_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _run(tmp_path, ("wandb",), wandb_project="proj")
    import wandb

    wandb.teardown()  # wait for wandb's writer process to flush the run file
    run_id = (tmp_path / loggers_module.WANDB_RUN_FILE).read_text().strip()
    (record_file,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    data = record_file.read_bytes()  # protobuf records: names and JSON values appear verbatim
    assert b"reward/mean" in data and b"timing/step" in data
    assert b"samples" in data and b"table-file" in data  # the sample tables, as W&B tables
    assert b'{"optim":{"lr":1e-6}}' in data  # the config section `actor`


def test_a_missing_package_names_the_extra_to_install(tmp_path, monkeypatch):
    real = loggers_module.importlib.util.find_spec
    monkeypatch.setattr(loggers_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RLHFError, match=r"pip install -e '\.\[wandb\]'"):
        MetricsLogger(tmp_path, total_steps=1, start_step=0, job_name="job",
                      loggers=("jsonl", "wandb"), progress=False)


def test_loggers_are_checked_in_the_config():
    assert TrainerConfig().loggers == ("console", "jsonl")
    with pytest.raises(ConfigError, match="trainer.loggers"):
        build(TrainerConfig, {"loggers": ["console", "neptune"]}, "trainer")
    with pytest.raises(ConfigError, match="twice"):
        TrainerConfig(loggers=("jsonl", "jsonl"))


def test_flatten_turns_the_config_tree_into_dotted_params():
    assert loggers_module.flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": None}) == \
        {"a.b.c": 1, "a.d": [1, 2], "e": None}
