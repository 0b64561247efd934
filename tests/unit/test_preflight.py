"""Pre-launch checks: `rlhf config show` (and `rlhf train` / `rlhf sft`, before Ray starts)
report every file, folder, reward import, pool and output-folder problem in one line."""

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaForSequenceClassification

from rlhf.cli import main
from rlhf.config import config_from_dict, config_to_dict
from rlhf.engine.checkpoint import ENGINE_FILE
from rlhf.errors import ConfigError
from rlhf.preflight import pool_problems, preflight
from rlhf.trainer.checkpoint import CheckpointManager, layout_differences
from rlhf.trainer.run_folder import move_old_run_aside, restart_line, write_run_identity
from tests.ray_echo import ray_echo_muted
from tests.unit.trainer.jobs import TINY, make_assets

REWARD_OK = "def score(*, prompt, response, ground_truth, extra):\n    return 1.0\n"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    paths = make_assets(root)
    torch.manual_seed(0)
    LlamaForSequenceClassification.from_pretrained(
        paths["model"], num_labels=1, dtype=torch.float32).save_pretrained(root / "rm")
    paths["rm"] = str(root / "rm")
    (root / "table.csv").write_text("prompt,ground_truth\n1+1,2\n")
    (root / "a_folder").mkdir()
    (root / "a_file").write_text("not a folder")
    (root / "empty_model").mkdir()
    (root / "no_tokenizer").mkdir()
    (root / "no_prompt.jsonl").write_text('{"question": "1+1", "ground_truth": "2"}\n')
    for name, body in (("exits.py", "import sys\nsys.exit(0)\n" + REWARD_OK),
                       ("hangs.py", "import time\ntime.sleep(600)\n" + REWARD_OK),
                       ("good.py", REWARD_OK)):
        (root / name).write_text(body)
    paths["root"] = str(root)
    return paths


def tree(assets, out: Path) -> dict:
    """A sound GAE job on 2 local CPU ranks, as the YAML tree `config show` reads."""
    return {
        "model": {"path": assets["model"]},
        "actor": {"ppo_mini_batch_size": 2, "max_tokens_per_micro_batch": 256},
        "critic": {"ppo_mini_batch_size": 2, "max_tokens_per_micro_batch": 256},
        "reward": {"functions": [{"path": "rlhf.rewards.arith:exact_match"}]},
        "rollout": {"n": 2, "max_new_tokens": 4, "cpu_kv_cache_gb": 0.05},
        "data": {"train_files": [assets["train"]], "val_files": [assets["val"]],
                 "max_prompt_length": 24, "train_batch_size": 4},
        "trainer": {"output_dir": str(out), "total_steps": 3, "device": "cpu",
                    "ranks_per_node": 2},
        "ray": {"num_cpus": 2},
    }


@pytest.fixture
def config_file(assets, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tree(assets, tmp_path / "run")))
    return path


def show(config_file, *overrides) -> tuple[int, str, str]:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out, err = io.StringIO(), io.StringIO()
    with ray_echo_muted(), redirect_stdout(out), redirect_stderr(err):
        code = main(["config", "show", str(config_file), *overrides])
    return code, out.getvalue(), err.getvalue()


def test_the_sound_job_passes(config_file):
    code, out, err = show(config_file)
    assert (code, err) == (0, "") and out.startswith("model:\n")


# (overrides with {root}/{model}/{rm} filled in, text the one error line must contain)
BROKEN = {
    "missing train file": (["data.train_files=[{root}/absent.jsonl]"],
                           "data.train_files[0]='{root}/absent.jsonl' does not exist"),
    "missing val file": (["data.val_files=[{root}/absent.jsonl]"],
                         "data.val_files[0]='{root}/absent.jsonl' does not exist"),
    "csv train file": (["data.train_files=[{root}/table.csv]"],
                       "data.train_files[0]='{root}/table.csv': unsupported data file type"),
    "folder as data file": (["data.train_files=[{root}/a_folder]"],
                            "data.train_files[0]='{root}/a_folder': {root}/a_folder is not a "
                            "complete indexed dataset (no manifest.json)"),
    "first row lacks the prompt key": (["data.train_files=[{root}/no_prompt.jsonl]"],
                                       "data.train_files[0]: {root}/no_prompt.jsonl:1: no "
                                       "'prompt' field"),
    "missing model folder": (["model.path={root}/absent_model"],
                             "model.path='{root}/absent_model': no such folder"),
    "model path is a file": (["model.path={root}/a_file"],
                             "model.path: cannot read '{root}/a_file/config.json'"),
    "model folder without config": (["model.path={root}/empty_model"],
                                    "model.path: '{root}/empty_model' exists but has no "
                                    "config.json"),
    "missing critic folder": (["critic.model_path={root}/absent_critic"],
                              "critic.model_path='{root}/absent_critic': no such folder"),
    "missing reward model": (["reward.model_path={root}/absent_rm"],
                             "reward.model_path='{root}/absent_rm': no such folder"),
    "causal LM as reward model": (["reward.model_path={model}"],
                                  "reward.model_path='{model}' holds no value head"),
    "missing tokenizer folder": (["model.tokenizer_path={root}/absent_tok"],
                                 "model.tokenizer_path='{root}/absent_tok': no such folder"),
    "folder without tokenizer": (["model.tokenizer_path={root}/no_tokenizer"],
                                 "model.tokenizer_path='{root}/no_tokenizer' holds no tokenizer"),
    "resume names no checkpoint": (["trainer.resume={root}/a_folder"],
                                   "trainer.resume={root}/a_folder: trainer.resume="),
    "pool larger than the local Ray": (["trainer.ranks_per_node=4", "ray.num_cpus=2"],
                                       "the training job needs 4 ranks"),
    "rollout pool beyond the local Ray": (["rollout.placement=separate", "rollout.world_size=1",
                                           "ray.num_cpus=2"],
                                          "the training job needs 3 ranks"),
    "reward file exits at import": (["reward.functions=[{{path: '{root}/exits.py:score'}}]"],
                                    "reward.functions[0].path: reward function "
                                    "'{root}/exits.py:score': importing it ended the process"),
    "reward file hangs at import": (["reward.functions=[{{path: '{root}/hangs.py:score'}}]",
                                     "reward.import_timeout_s=3"],
                                    "reward.functions[0].path: reward function '{root}/hangs.py"
                                    ":score': importing it did not finish within 3 s"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_config_show_reports_each_broken_input_in_one_line(case, assets, config_file):
    overrides, want = BROKEN[case]
    fill = {"root": assets["root"], "model": assets["model"], "rm": assets["rm"]}
    code, out, err = show(config_file, *[o.format(**fill) for o in overrides])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert want.format(**fill) in err
    assert "Traceback" not in err


def test_several_problems_are_listed_together(assets, config_file):
    code, _, err = show(config_file, f"data.val_files=[{assets['root']}/absent.jsonl]",
                        f"critic.model_path={assets['root']}/absent_critic")
    assert code == 2 and err.startswith("error: 2 problems in the job's inputs:")
    assert "data.val_files[0]" in err and "critic.model_path" in err


def test_a_reward_file_that_raises_at_import_is_named_with_its_traceback(assets, config_file,
                                                                         tmp_path):
    bad = tmp_path / "raises.py"
    bad.write_text("raise RuntimeError('no credentials for the judge')\n" + REWARD_OK)
    code, _, err = show(config_file, f"reward.functions=[{{path: '{bad}:score'}}]")
    assert code == 2 and err.startswith(f"error: reward.functions[0].path: reward function "
                                        f"'{bad}:score': running '{bad}' failed")
    assert "no credentials for the judge" in err and "preflight" not in err


def test_a_reward_model_with_a_value_head_and_no_functions_passes(assets, config_file):
    code, _, err = show(config_file, f"reward.model_path={assets['rm']}", "reward.functions=[]")
    assert (code, err) == (0, "")


def test_train_and_sft_stop_before_ray_starts(assets, config_file, monkeypatch):
    import rlhf.trainer.jobs as session

    def no_ray(*args, **kwargs):  # Ray may already run in this test session: watch the call
        raise AssertionError("init_ray reached")

    monkeypatch.setattr(session, "init_ray", no_ray)
    missing = f"data.train_files=[{assets['root']}/absent.jsonl]"
    assert main(["train", str(config_file), missing]) == 2
    assert main(["sft", str(config_file), f"sft.train_files=[{assets['root']}/absent.jsonl]",
                 "sft.total_steps=2"]) == 2


def test_train_refuses_a_sound_job_that_does_not_fit_before_ray_starts(config_file, capsys,
                                                                      monkeypatch):
    """The memory plan runs right after the input checks: a job whose inputs are all sound but
    whose plan exceeds trainer.device_memory_gb stops with exit 2 before Ray, naming the way
    past it for experts."""
    import rlhf.trainer.jobs as session

    def no_ray(*args, **kwargs):
        raise RuntimeError("init_ray reached")

    monkeypatch.setattr(session, "init_ray", no_ray)
    assert main(["train", str(config_file), "trainer.device_memory_gb=0.01"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "trainer.skip_memory_check=true" in err
    with pytest.raises(RuntimeError, match="init_ray reached"):  # the expert's way past it
        main(["train", str(config_file), "trainer.device_memory_gb=0.01",
              "trainer.skip_memory_check=true"])


def test_a_model_that_sft_will_write_may_be_absent_for_show_but_not_train(assets, tmp_path):
    t = tree(assets, tmp_path / "run")
    t["model"] = {"path": str(tmp_path / "sft_out")}
    t["sft"] = {"output_path": str(tmp_path / "sft_out"), "init_path": assets["model"],
                "train_files": [assets["sft"]], "total_steps": 2}
    cfg = config_from_dict(t)
    preflight(cfg, command="show", ray_address=None)
    preflight(cfg, command="sft", ray_address=None)
    with pytest.raises(ConfigError, match="run `rlhf sft CONFIG` first"):
        preflight(cfg, command="train", ray_address=None)
    shutil.copytree(assets["model"], tmp_path / "sft_out")  # as if `rlhf sft` had run
    preflight(cfg, command="train", ray_address=None)
    with pytest.raises(ConfigError, match=r"^sft.output_path: '.*sft_out' already holds a model"):
        preflight(cfg, command="sft", ray_address=None)


def test_an_existing_cluster_is_checked_by_pool_problems(assets, tmp_path):
    t = tree(assets, tmp_path / "run")
    t["ref"] = {"placement": "separate", "world_size": 2, "max_tokens_per_micro_batch": 256}
    t["algorithm"] = {"kl_in_reward": True}
    cfg = config_from_dict(t)
    assert pool_problems(cfg, "train", cpus=4, gpus=None, where="the cluster") == []
    (line,) = pool_problems(cfg, "train", cpus=3, gpus=None, where="the cluster")
    assert "needs 4 ranks" in line and "ref.world_size=2" in line and "has 3 CPUs" in line
    (line,) = pool_problems(cfg, "train", cpus=16, gpus=2, where="the cluster")
    assert "has 2 GPUs" in line
    # each rank holds trainer.cpus_per_rank CPUs (null: at least one, its node's share)
    t["trainer"] = {**t.get("trainer", {}), "cpus_per_rank": 4}
    (line,) = pool_problems(config_from_dict(t), "train", cpus=8, gpus=4, where="the cluster")
    assert "4 (trainer.cpus_per_rank) CPU each" in line and "has 8 CPUs" in line


@pytest.mark.parametrize("logger", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_tracker_package_names_its_extra(assets, tmp_path, monkeypatch, logger):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == logger else real(name, *a))
    cfg = config_from_dict({**tree(assets, tmp_path / "run"),
                            "trainer": {**tree(assets, tmp_path)["trainer"],
                                        "output_dir": str(tmp_path / "run"),
                                        "loggers": ["console", logger]}})
    with pytest.raises(ConfigError, match=rf"pip install -e '\.\[{logger}\]'"):
        preflight(cfg, command="train", ray_address=None)


# ---- output folders and resuming -------------------------------------------------------------

def saved_run(assets, out: Path, **trainer) -> dict:
    """The tree of a job whose output folder holds one checkpoint and metrics of its own."""
    t = tree(assets, out)
    cfg = config_from_dict(t)
    ckpt = CheckpointManager(out)
    ckpt.save(1, write_roles=lambda f: (f / "actor").mkdir(),
              state={"step": 1, "config": config_to_dict(cfg)})
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    t["trainer"].update(trainer)
    return t


def test_resume_never_into_another_run_is_refused_naming_both_ways_out(assets, tmp_path):
    out = tmp_path / "run"
    t = saved_run(assets, out, resume="never")
    with pytest.raises(ConfigError) as info:
        preflight(config_from_dict(t), command="train", ray_address=None)
    message = str(info.value)
    assert f"trainer.output_dir='{out}' holds another run" in message
    assert "another trainer.output_dir" in message and "trainer.overwrite=true" in message
    t["trainer"]["overwrite"] = True
    checked = preflight(config_from_dict(t), command="train", ray_address=None)
    assert checked.move_old_run_aside
    moved = move_old_run_aside(out)
    assert (moved / "checkpoints" / "step_1" / "manifest.json").is_file()
    assert (moved / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    t["trainer"]["overwrite"] = False
    assert not preflight(config_from_dict(t), command="train", ray_address=None).move_old_run_aside


RUN_CHANGES = {
    "another algorithm": ({"algorithm": {"adv_estimator": "grpo"}},
                          "algorithm.adv_estimator: \"gae\" -> \"grpo\""),
    "another reward": ({"reward": {"functions": [{"path": "rlhf.rewards.gsm8k:score"}]}},
                       "reward.functions:"),
    "another data file": ({"data": {"train_files": ["{val}"]}}, "data.train_files:"),
}


@pytest.mark.parametrize("case", sorted(RUN_CHANGES))
def test_resume_with_a_config_that_defines_another_run_stops(case, assets, tmp_path):
    change, want = RUN_CHANGES[case]
    t = saved_run(assets, tmp_path / "run")
    for section, values in change.items():
        values = yaml.safe_load(yaml.safe_dump(values).replace("'{val}'", assets["val"]))
        t[section] = {**t.get(section, {}), **values}
    with pytest.raises(ConfigError) as info:
        preflight(config_from_dict(t), command="train", ray_address=None)
    assert "keys that define the run differ" in str(info.value) and want in str(info.value)
    assert "trainer.allow_config_change=true" in str(info.value)
    t["trainer"]["allow_config_change"] = True
    preflight(config_from_dict(t), command="train", ray_address=None)


def test_resume_with_another_model_at_the_same_path_stops(assets, tmp_path):
    from rlhf.demo.tiny_model import make_tiny_model

    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    t = saved_run({**assets, "model": str(model)}, tmp_path / "run")
    shutil.rmtree(model)
    make_tiny_model(TINY.__class__(**{**TINY.__dict__, "num_layers": 3}), model)
    with pytest.raises(ConfigError, match=r"config.json: another model than the checkpoint's"):
        preflight(config_from_dict(t), command="train", ray_address=None)


def test_safe_changes_resume(assets, tmp_path):
    t = saved_run(assets, tmp_path / "run", total_steps=9, val_every=1, save_every=2)
    t["actor"]["optim"] = {"lr": 5e-5}
    checked = preflight(config_from_dict(t), command="train", ray_address=None)
    assert checked.notes == [f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step_1'}"]


def test_a_checkpoint_with_relative_paths_resumes_under_the_resolved_config(assets, tmp_path,
                                                                          monkeypatch):
    """Runs saved before the driver resolved paths recorded them relative to its folder."""
    from rlhf.config.paths import resolve_paths

    monkeypatch.chdir(tmp_path)
    shutil.copytree(assets["model"], tmp_path / "model")
    t = saved_run({**assets, "model": "model"}, tmp_path / "run")
    cfg = resolve_paths(config_from_dict(t), base=tmp_path)
    assert cfg.model.path == str(tmp_path / "model")
    checked = preflight(cfg, command="train", ray_address=None)
    assert checked.notes == [f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step_1'}"]


def test_config_show_says_which_checkpoint_it_would_skip_and_resume(assets, tmp_path):
    out = tmp_path / "run"
    t = saved_run(assets, out)

    def write_roles(folder):
        (folder / "actor").mkdir()
        (folder / "actor" / "w.pt").write_bytes(b"\1" * 64)

    CheckpointManager(out).save(2, write_roles=write_roles,
                                state={"step": 2, "config": config_to_dict(config_from_dict(t))})
    (out / "checkpoints" / "step_2" / "actor" / "w.pt").write_bytes(b"\2" * 64)  # same size
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(t))
    code, stdout, err = show(config)
    assert code == 0 and stdout.startswith("model:\n")
    assert err.splitlines() == [
        "checkpoint step_2 is damaged: actor/w.pt hash mismatch (its bytes changed after the "
        "save); skipped",
        f"resuming from {out / 'checkpoints' / 'step_1'}"]


def test_metrics_of_a_run_without_checkpoints_are_not_appended_to(assets, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # a run that died before its first save
    cfg = config_from_dict(tree(assets, out))
    with pytest.raises(ConfigError, match=r"holds another run \(checkpoints/ or metrics.jsonl\) "
                                          r"and it has no checkpoint to resume"):
        preflight(cfg, command="train", ray_address=None)


# ---- resuming at another size, and a folder left by an earlier attempt of the same run ----

@pytest.mark.parametrize("change", [{"ranks_per_node": 1}, {"ranks_per_node": 4},
                                    {"nnodes": 2, "ranks_per_node": 1}])
def test_another_data_parallel_size_resumes(change, assets, tmp_path):
    t = saved_run(assets, tmp_path / "run", **change)
    t["ray"]["num_cpus"] = 4
    checked = preflight(config_from_dict(t), command="train", ray_address="auto")
    assert checked.notes == [f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step_1'}"]


def test_another_tensor_or_pipeline_layout_stops_naming_both(assets, tmp_path):
    t = saved_run(assets, tmp_path / "run", allow_config_change=True)  # no way around it
    t["actor"]["parallel"] = {"tp": 2}
    t["critic"]["parallel"] = {"pp": 2}  # the checkpoint holds no critic: not a difference
    with pytest.raises(ConfigError) as info:
        preflight(config_from_dict(t), command="train", ray_address=None)
    message = str(info.value)
    assert "another model-parallel layout: actor: tp=1 pp=1 -> tp=2 pp=1;" in message
    assert "critic" not in message.split("layout:")[1].split(";")[0]
    assert "rlhf export-hf" in message


def test_a_dcp_checkpoint_resumes_at_another_model_parallel_layout(assets, tmp_path):
    out = tmp_path / "run"
    t = saved_run(assets, out)
    (out / "checkpoints" / "step_1" / "actor" / ENGINE_FILE).write_text("{}")  # a DCP role
    CheckpointManager(out).save(1, write_roles=lambda f: shutil.copytree(
        out / "checkpoints" / "step_1" / "actor", f / "actor"), state={
        "step": 1, "config": config_to_dict(config_from_dict(t))})
    t["actor"]["parallel"] = {"tp": 2}  # the pool has 2 ranks
    checked = preflight(config_from_dict(t), command="train", ray_address=None)
    assert checked.notes == [f"resuming from {out / 'checkpoints' / 'step_1'}"]


def test_another_expert_parallel_size_is_a_layout_change_naming_both():
    # ep decides which experts a rank holds (its own checkpoint files); dp may still change.
    saved = {"actor": {"parallel": {"tp": 1, "pp": 1, "ep": 2}}}
    assert layout_differences(saved, {"actor": {"parallel": {"tp": 1, "pp": 1, "ep": 1}}}) == [
        "actor: tp=1 pp=1 ep=2 -> tp=1 pp=1 ep=1"]
    assert layout_differences(saved, {"actor": {"parallel": {"tp": 1, "pp": 1, "ep": 2,
                                                             "world_size": 8}}}) == []


def _write_leftovers(out: Path, stage: str) -> None:
    """What `rlhf train` leaves when SIGKILLed at `stage` of its first save (step 1)."""
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    if stage == "logged, before the save":
        return
    tmp = out / "checkpoints" / ".step_1.tmp-123-abcd"
    (tmp / "actor").mkdir(parents=True)
    (tmp / "actor" / "engine_pp00_tp00.pt").write_bytes(b"x" * 100)  # shards (or part of one)
    if stage == "shards written":
        return
    (tmp / "trainer_state.pt").write_bytes(b"state")
    if stage == "state written":
        return
    (tmp / "manifest.json").write_text("{}")  # complete, never renamed to step_1


STAGES = ["logged, before the save", "shards written", "state written", "manifest written"]


@pytest.mark.parametrize("stage", STAGES)
def test_an_attempt_killed_in_its_first_save_restarts_with_its_leftovers_moved_aside(
        stage, assets, tmp_path):
    out = tmp_path / "run"
    t = tree(assets, out)
    cfg = config_from_dict(t)
    out.mkdir()
    write_run_identity(out, config_to_dict(cfg))  # what run_train writes before step 1
    _write_leftovers(out, stage)
    checked = preflight(cfg, command="train", ray_address=None)
    assert checked.move_old_run_aside and checked.restart
    assert checked.notes == [f"{out} holds an earlier attempt of this run that completed no "
                             "checkpoint: `rlhf train` moves it aside and starts from step 1"]
    moved = move_old_run_aside(out)
    assert (moved / "metrics.jsonl").is_file() and (moved / "run.json").is_file()
    if stage != STAGES[0]:
        assert list((moved / "checkpoints").glob(".step_1.tmp-*"))
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert "earlier attempt of this run" in restart_line(out, moved) and str(moved) in \
        restart_line(out, moved)
    again = preflight(cfg, command="train", ray_address=None)
    assert not again.move_old_run_aside and not again.restart


@pytest.mark.parametrize("identity", ["another run", "none (an older version)"])
def test_leftovers_of_another_run_are_still_refused(identity, assets, tmp_path):
    out = tmp_path / "run"
    t = tree(assets, out)
    out.mkdir()
    if identity == "another run":
        other = tree(assets, out)
        other["algorithm"] = {"adv_estimator": "grpo"}
        write_run_identity(out, config_to_dict(config_from_dict(other)))
    _write_leftovers(out, "shards written")
    with pytest.raises(ConfigError, match="holds another run"):
        preflight(config_from_dict(t), command="train", ray_address=None)
    t["trainer"]["resume"] = "never"  # never resumes, so never restarts either
    with pytest.raises(ConfigError, match="holds another run"):
        preflight(config_from_dict(t), command="train", ray_address=None)


def test_a_changed_model_at_the_same_path_is_another_run(assets, tmp_path):
    from rlhf.demo.tiny_model import make_tiny_model

    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(assets["model"], model)
    t = tree({**assets, "model": str(model)}, out)
    out.mkdir()
    write_run_identity(out, config_to_dict(config_from_dict(t)))
    _write_leftovers(out, "shards written")
    shutil.rmtree(model)
    make_tiny_model(TINY.__class__(**{**TINY.__dict__, "num_layers": 3}), model)
    with pytest.raises(ConfigError, match="holds another run"):
        preflight(config_from_dict(t), command="train", ray_address=None)
