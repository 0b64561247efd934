"""`rlhf config from-verl`: a verl GRPO config becomes ours, with what has no equivalent named."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.cli import main
from rlhf.config import load_config
from rlhf.config.from_verl import VERL_KEYS, translate
from rlhf.config.loader import dotted_keys
from rlhf.config.schema import JobConfig
from rlhf.rewards import load_reward_function

REPO = Path(__file__).parents[3]

VERL_YAML = """\
data:
  train_files: {train}
  val_files: {train}
  train_batch_size: 4
  max_prompt_length: 256
  max_response_length: 300
actor_rollout_ref:
  model:
    path: {model}
    enable_gradient_checkpointing: true
  actor:
    strategy: fsdp
    optim: {{lr: 3.0e-6, lr_warmup_steps: -1}}
    ppo_mini_batch_size: 2
    ppo_micro_batch_size_per_gpu: 1
    use_kl_loss: true
    kl_loss_type: low_var_kl
    clip_ratio: 0.28
    use_torch_compile: false
    some_new_knob: 3
  rollout:
    name: vllm
    tensor_model_parallel_size: 2
    n: 4
    val_kwargs: {{do_sample: true, n: 8, temperature: 0.6, top_p: 0.95}}
algorithm:
  adv_estimator: grpo
  kl_ctrl: {{type: fixed, kl_coef: 0.002}}
custom_reward_function: {{path: {reward}, name: my_score}}
trainer:
  logger: [console, wandb, swanlab]
  n_gpus_per_node: 4
  test_freq: -1
  save_freq: 10
  total_epochs: 3
"""


@pytest.fixture
def verl_job(tmp_path):
    train = tmp_path / "train.parquet"
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+1"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), train)
    reward = tmp_path / "my_reward.py"
    reward.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(solution_str == ground_truth)\n")
    path = tmp_path / "verl.yaml"
    path.write_text(VERL_YAML.format(train=train, model=tmp_path / "model", reward=reward))
    return path


def test_the_table_names_only_keys_that_exist_here():
    ours = set(dotted_keys(JobConfig))
    assert not [key for entry in VERL_KEYS for key in entry.ours if key not in ours]
    verl = [entry.verl for entry in VERL_KEYS]
    assert len(verl) == len(set(verl))
    assert all(entry.note for entry in VERL_KEYS if not entry.ours)  # every gap says why


def test_a_verl_grpo_config_translates_and_loads(verl_job, tmp_path, capsys):
    out = tmp_path / "ours.yaml"
    assert main(["config", "from-verl", str(verl_job), "trainer.nnodes=2",
                 "actor_rollout_ref.rollout.n=8", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    cfg = load_config(out)
    assert cfg.data.ground_truth_key == "reward_model.ground_truth"
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length) == (4, 256)
    assert cfg.rollout.max_new_tokens == 300 and (cfg.rollout.tp, cfg.rollout.n) == (2, 8)
    assert cfg.actor.optim.lr == 3e-6 and cfg.actor.optim.warmup_steps == 0
    assert cfg.actor.recompute == "full" and cfg.actor.ppo_mini_batch_size == 2
    assert cfg.actor.compile == "off"
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high) == (0.28, 0.28)
    assert cfg.algorithm.kl_loss_type == "k3" and cfg.algorithm.use_kl_loss
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.kl_coef == 0.002
    assert [(f.path, f.convention) for f in cfg.reward.functions] == [
        (f"{tmp_path}/my_reward.py:my_score", "verl")]
    assert (cfg.trainer.nnodes, cfg.trainer.ranks_per_node) == (2, 4)
    assert (cfg.trainer.val_every, cfg.trainer.save_every) == (0, 10)
    sampling = cfg.trainer.val_sampling
    assert (sampling.n, sampling.temperature, sampling.top_p) == (8, 0.6, 0.95)
    assert cfg.trainer.total_steps == 3 * (10 // 4)  # epochs counted in the Parquet file's rows
    assert cfg.trainer.loggers == ("console", "wandb", "jsonl")
    assert "no equivalent: actor_rollout_ref.actor.strategy: this engine shards by tp/pp" in err
    assert "no equivalent: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in err
    assert "not translated (not in the table): actor_rollout_ref.actor.some_new_knob" in err
    assert "trainer.logger: ['swanlab'] left out" in err
    text = out.read_text()
    assert "#   data.max_response_length -> rollout.max_new_tokens" in text


def test_verl_defaults_fill_unset_keys_and_a_bad_result_says_so(tmp_path, capsys):
    translation = translate({"actor_rollout_ref.model.path": "Qwen/Qwen2.5-7B-Instruct",
                             "algorithm.adv_estimator": "gae"})
    tree = translation.tree
    assert tree["data"]["train_batch_size"] == 1024 and tree["trainer"]["ranks_per_node"] == 8
    assert tree["actor"]["ppo_mini_batch_size"] == tree["critic"]["ppo_mini_batch_size"] == 256
    assert any("looks like a hub name" in note for note in translation.notes)
    assert [key for key, _ in translation.no_equivalent] == ["trainer.total_epochs"]
    greedy_only = translate({"actor_rollout_ref.rollout.val_kwargs.n": 4,
                             "actor_rollout_ref.rollout.val_kwargs.do_sample": False})
    assert "val_sampling" not in greedy_only.tree.get("trainer", {})
    path = tmp_path / "v.yaml"
    path.write_text("actor_rollout_ref.actor.kl_loss_type: full\n")
    assert main(["config", "from-verl", str(path)]) == 1
    captured = capsys.readouterr()
    assert "no equivalent: actor_rollout_ref.actor.kl_loss_type: 'full': the estimators" in (
        captured.err)
    assert "does not load yet" in captured.err and "reward.functions is empty" in captured.err
    assert captured.out.startswith("# Translated from verl's v.yaml")


def test_the_verl_example_translates_and_its_reward_runs_unchanged(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["config", "from-verl", "examples/verl/grpo_gsm8k.yaml"]) == 0
    out = capsys.readouterr().out
    assert "- path: examples/verl/gsm8k_reward.py:compute_score\n    convention: verl" in out
    assert "device: cuda" in out  # verl's jobs run on GPUs; our default would pick the CPU here
    fn = load_reward_function("examples/verl/gsm8k_reward.py:compute_score")
    sample = {"prompt": "q", "ground_truth": "72", "extra": {"data_source": "openai/gsm8k"}}
    assert [fn(response=r, **sample) for r in ("so #### 72", "#### 7", "72")] == [1.0, 0.1, 0.0]
