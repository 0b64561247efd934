"""YAML files, `base:` inheritance, typed overrides, strict keys and the YAML round trip."""

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algorithms import algorithm_needs
from rlhf.config import (
    ConfigError,
    JobConfig,
    OptimizerConfig,
    RewardFunctionConfig,
    TinyModelConfig,
    TrainerConfig,
    config_from_dict,
    config_to_dict,
    format_config,
    load_config,
)
from rlhf.config.loader import parse_yaml

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
GRPO = CONFIGS / "grpo_quickstart.yaml"
# The two keys the defaults leave empty on purpose (a job needs data and a reward).
MINIMAL = ["data.train_files=[train.jsonl]", "reward.functions=[{path: 'pkg.mod:score'}]"]


@pytest.fixture
def write(tmp_path):
    def write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path
    return write


def test_shipped_quickstart_loads():
    cfg = load_config(QUICKSTART)
    assert cfg.algorithm.adv_estimator == "gae" and algorithm_needs(cfg).critic
    assert cfg.trainer.device == "cpu" and cfg.trainer.pool_size == 2
    assert cfg.model.tiny == TinyModelConfig(arch="llama")
    assert cfg.reward.functions == (RewardFunctionConfig(path="rlhf.rewards.arith:exact_match",
                                                         weight=1.0),)
    assert cfg.data.train_files == ("outputs/quickstart/data/train.jsonl",)
    assert cfg.ray.num_cpus == 2


def test_shipped_grpo_inherits_quickstart():
    base, cfg = load_config(QUICKSTART), load_config(GRPO)
    assert cfg.algorithm.adv_estimator == "grpo" and not algorithm_needs(cfg).critic
    assert cfg.algorithm.use_kl_loss and not cfg.algorithm.kl_in_reward
    assert cfg.rollout.n == base.rollout.n == 8  # kept from the base file
    assert (cfg.model, cfg.actor, cfg.data, cfg.rollout) == (base.model, base.actor, base.data,
                                                             base.rollout)
    assert cfg.trainer.output_dir != base.trainer.output_dir


def test_defaults_need_data_and_a_reward():
    with pytest.raises(ConfigError) as info:
        load_config(None)
    assert "data.train_files" in str(info.value) and "reward.functions" in str(info.value)
    cfg = load_config(None, MINIMAL)
    expected = JobConfig()
    assert cfg.actor == expected.actor and cfg.trainer == expected.trainer
    assert cfg.critic.optim.lr == 1e-5  # the critic's own default, not OptimizerConfig's
    assert OptimizerConfig().lr == cfg.actor.optim.lr == 1e-6


def test_config_is_frozen_and_hashable():
    cfg = load_config(QUICKSTART)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.optim.lr = 1.0
    assert hash(cfg) == hash(load_config(QUICKSTART))
    assert {cfg: 1}[load_config(QUICKSTART)] == 1


OVERRIDES = {
    "int": ("actor.parallel.tp=2", lambda c: c.actor.parallel.tp, 2),
    "float-exponent": ("actor.optim.lr=1e-5", lambda c: c.actor.optim.lr, 1e-5),
    "float-from-int": ("reward.timeout_s=3", lambda c: c.reward.timeout_s, 3.0),
    "bool-true": ("trainer.ray_metrics=true", lambda c: c.trainer.ray_metrics, True),
    "bool-upper": ("trainer.ray_metrics=TRUE", lambda c: c.trainer.ray_metrics, True),
    "bool-false": ("data.shuffle=False", lambda c: c.data.shuffle, False),
    "str": ("trainer.experiment_name=run-1", lambda c: c.trainer.experiment_name, "run-1"),
    "str-looks-numeric": ("trainer.experiment_name=2024", lambda c: c.trainer.experiment_name,
                          "2024"),
    "str-looks-bool": ("trainer.resume=true", lambda c: c.trainer.resume, "true"),
    "literal": ("actor.optim.schedule=cosine", lambda c: c.actor.optim.schedule, "cosine"),
    "optional-set": ("critic.model_path=models/critic", lambda c: c.critic.model_path,
                     "models/critic"),
    "optional-none": ("actor.optim.grad_clip=null", lambda c: c.actor.optim.grad_clip, None),
    "optional-tilde": ("rollout.tis_cap=~", lambda c: c.rollout.tis_cap, None),
    "optional-dataclass-none": ("model.tiny=null", lambda c: c.model.tiny, None),
    "tuple-of-str": ("data.val_files=[a.jsonl, b.jsonl]", lambda c: c.data.val_files,
                     ("a.jsonl", "b.jsonl")),
    "tuple-single-string": ("rollout.stop=</s>", lambda c: c.rollout.stop, ("</s>",)),
    "fixed-tuple": ("actor.optim.betas=[0.8, 0.95]", lambda c: c.actor.optim.betas, (0.8, 0.95)),
    "nested-field": ("model.tiny.num_layers=2", lambda c: c.model.tiny.num_layers, 2),
    "nested-dataclass": ("critic.optim={weight_decay: 0.1}", lambda c: c.critic.optim,
                         OptimizerConfig(lr=1e-3, weight_decay=0.1)),
    "tuple-of-dataclasses": ("reward.functions=[{path: 'm:f', weight: 2}, {path: 'r.py:g'}]",
                             lambda c: c.reward.functions,
                             (RewardFunctionConfig(path="m:f", weight=2.0),
                              RewardFunctionConfig(path="r.py:g", weight=1.0))),
}


@pytest.mark.parametrize("override, get, expected", OVERRIDES.values(), ids=OVERRIDES.keys())
def test_override_of_every_type(override, get, expected):
    value = get(load_config(QUICKSTART, [override]))
    assert value == expected and type(value) is type(expected)


def test_tuple_override_of_ints():
    cfg = load_config(QUICKSTART, ["actor.parallel.pp=2", "actor.parallel.layers_per_stage=[1,3]"])
    assert cfg.actor.parallel.layers_per_stage == (1, 3)


def test_later_overrides_win_and_nested_mapping_keeps_the_file_values():
    cfg = load_config(QUICKSTART, ["actor.optim.lr=1e-3", "actor.optim.lr=2e-3"])
    assert cfg.actor.optim.lr == 2e-3
    assert cfg.actor.max_tokens_per_micro_batch == 2048  # from the file, untouched


@pytest.mark.parametrize("override, expected_type, got", [
    ("actor.parallel.tp=abc", "int", "'abc'"),
    ("actor.optim.lr=[1]", "float", "[1]"),
    ("trainer.ray_metrics=maybe", "bool", "'maybe'"),
    ("rollout.n=null", "int", "null"),
    # Strict types: a number is never read from a string, an int never from a float, and only
    # true/false are booleans (YAML 1.1's yes/on, 1, or a quoted 'true' are not).
    ("trainer.total_steps='7'", "int", "'7'"),
    ("trainer.total_steps=8.0", "int", "8.0"),
    ("trainer.total_steps=true", "int", "True"),
    ("actor.optim.lr='2e-6'", "float", "'2e-6'"),
    ("actor.optim.lr=.nan", "finite float", "nan"),
    ("trainer.ray_metrics=yes", "bool", "'yes'"),
    ("trainer.ray_metrics=1", "bool", "1"),
    ("data.shuffle='true'", "bool", "'true'"),
    ("rollout.reject_band=[0.5]", "[float, float]", "[0.5]"),
    ("rollout.stop=[1]", "str", "1"),
    ("actor.optim=3", "mapping", "3"),
    ("rollout.env.kwargs=[1]", "mapping", "[1]"),
])
def test_type_errors_name_key_type_and_value(override, expected_type, got):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, [override])
    message = str(info.value)
    assert message.startswith(key) and expected_type in message and got in message


def test_every_problem_is_one_line_naming_its_key(write):
    """pydantic reports all problems at once; each becomes one of our lines, none of its text."""
    path = write("c.yaml", f"base: {QUICKSTART}\nrollout: {{n: two}}\ntrainer: {{zzzq: 1}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["actor.optim.lr=-1", "reward.functions=[{weight: 2}]"])
    lines = str(info.value).splitlines()
    assert sorted(lines) == sorted([
        "rollout.n: expected int, got 'two' (str)",
        "actor.optim.lr must be positive, got -1.0",
        "unknown key 'trainer.zzzq' (valid keys under 'trainer': "
        + ", ".join(f.name for f in dataclasses.fields(TrainerConfig)) + ")",
        "missing key 'reward.functions[0].path' (str)"])


def test_a_partial_section_keeps_the_fields_own_defaults():
    """critic.optim's default has its own lr; setting another key of it keeps that lr."""
    cfg = load_config(None, MINIMAL + ["critic.optim.weight_decay=0.5"])
    assert cfg.critic.optim == OptimizerConfig(lr=1e-5, weight_decay=0.5)


@pytest.mark.parametrize("wrong, suggestion", [
    ("actor.optim.learning_rate", "actor.optim.lr"),
    ("actor.tp", "actor.parallel.tp"),
    ("rollout.temprature", "rollout.temperature"),
    ("algoritm.gamma", "algorithm"),
    ("ray.num_cpu", "ray.num_cpus"),
])
def test_unknown_override_key_suggests_the_closest(wrong, suggestion):
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, [f"{wrong}=1"])
    assert f"did you mean '{suggestion}'?" in str(info.value)


def test_unknown_key_in_a_file_is_named_in_full(write):
    path = write("c.yaml", f"base: {QUICKSTART}\nactor:\n  optim:\n    learning_rat: 1.0e-6\n")
    with pytest.raises(ConfigError, match=r"unknown key 'actor\.optim\.learning_rat'; "
                                          r"did you mean 'actor\.optim\.lr'\?"):
        load_config(path)


def test_nothing_similar_gives_no_suggestion():
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, ["trainer.zzzzqqq=1"])
    assert "did you mean" not in str(info.value) and "trainer.zzzzqqq" in str(info.value)


@pytest.mark.parametrize("text, fragment", [
    ("model: [unclosed\n", "not valid YAML"),
    ("- a\n- b\n", "must hold a mapping"),
    ("actor:\n  dtype: auto\n  dtype: float32\n", "duplicate key 'dtype'"),
    ("base: 3\n", "'base' must be a file name"),
    ("base: missing.yaml\n", "missing.yaml"),
])
def test_bad_files_name_the_file(write, text, fragment):
    path = write("bad.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert fragment in str(info.value)
    assert "bad.yaml" in str(info.value) or "missing.yaml" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_base_chain_is_relative_to_each_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text(f"base: {QUICKSTART}\nrollout:\n  n: 8\n")
    (tmp_path / "sub" / "leaf.yaml").write_text(
        "base: ../root.yaml\nrollout:\n  temperature: 0.7\nactor:\n  optim:\n    lr: 3.0e-6\n")
    cfg = load_config(tmp_path / "sub" / "leaf.yaml", ["rollout.top_p=0.9"])
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.rollout.top_p) == (8, 0.7, 0.9)
    assert cfg.actor.optim.lr == 3e-6
    assert cfg.actor.optim.weight_decay == load_config(QUICKSTART).actor.optim.weight_decay


def test_base_can_unset_a_mapping_with_null(write):
    cfg = load_config(write("c.yaml", f"base: {QUICKSTART}\nmodel:\n  tiny: null\n"))
    assert cfg.model.tiny is None and cfg.model.path == "outputs/quickstart/sft_model"


def test_base_loop_is_reported(write):
    write("a.yaml", "base: b.yaml\n")
    path = write("b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="loop"):
        load_config(path)


def test_yaml_scalars_follow_yaml_1_2():
    assert parse_yaml("[yes, on, 017, 1e-5, 2024-01-01, 0x10]") == [
        "yes", "on", 17.0, 1e-5, "2024-01-01", "0x10"]


def test_format_config_round_trips(tmp_path):
    for source in (QUICKSTART, GRPO):
        cfg = load_config(source, ["reward.functions=[{path: 'a.b:c', weight: 0.5}]",
                                   "rollout.stop=['\\n\\n', '017', 'yes', 'null']"])
        path = tmp_path / "resolved.yaml"
        path.write_text(format_config(cfg))
        assert load_config(path) == cfg


def test_config_to_dict_is_plain_and_complete():
    cfg = load_config(QUICKSTART)
    data = config_to_dict(cfg)
    assert list(data) == [f.name for f in dataclasses.fields(JobConfig)]
    assert data["actor"]["optim"]["betas"] == [0.9, 0.999]
    assert data["reward"]["functions"] == [{"path": "rlhf.rewards.arith:exact_match",
                                            "weight": 1.0, "convention": "auto"}]
    assert config_from_dict(data) == cfg


@settings(max_examples=60, deadline=None)
@given(name=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20),
       lr=st.floats(min_value=1e-12, max_value=10.0, allow_nan=False),
       stop=st.lists(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1,
                             max_size=5), max_size=3, unique=True))
def test_format_config_round_trips_any_value(name, lr, stop):
    cfg = load_config(QUICKSTART)
    cfg = dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, experiment_name=name),
        actor=dataclasses.replace(cfg.actor, optim=dataclasses.replace(cfg.actor.optim, lr=lr)),
        rollout=dataclasses.replace(cfg.rollout, stop=tuple(stop)))
    assert config_from_dict(parse_yaml(format_config(cfg))) == cfg
