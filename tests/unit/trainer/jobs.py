"""A tiny arithmetic job for the trainer tests: model, data files and a JobConfig."""

from pathlib import Path

from rlhf.config import TinyModelConfig, config_from_dict
from rlhf.demo.arithmetic_data import ArithTask, write_arith_dataset
from rlhf.demo.tiny_model import make_tiny_model

# Head size 32 has a vLLM CPU kernel; 2 heads, 2 kv heads and 2 layers allow tp=2 and pp=2.
TINY = TinyModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=2,
                       intermediate_size=96, vocab_size=384, max_position_embeddings=64)


def make_assets(root: Path) -> dict[str, str]:
    """The tiny model and rl / sft / val arithmetic files under `root`."""
    paths = {"model": str(make_tiny_model(TINY, root / "model"))}
    task = ArithTask(max_value=9)
    for name, kind, split, n in (("train", "rl", "train", 64), ("val", "rl", "val", 8),
                                 ("sft", "sft", "train", 64)):
        paths[name] = str(root / f"{name}.jsonl")
        write_arith_dataset(Path(paths[name]), task=task, n=n, seed=0, kind=kind, split=split)
    return paths


def merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def job_config(assets: dict, output_dir: Path, **sections):
    """PPO (GAE, KL in reward) on 2 colocated ranks; `sections` override parts of the tree."""
    tree = {
        "model": {"path": assets["model"]},
        "actor": {"ppo_mini_batch_size": 2, "max_tokens_per_micro_batch": 256,
                  "optim": {"lr": 1.0e-3}},
        "critic": {"ppo_mini_batch_size": 2, "max_tokens_per_micro_batch": 256},
        "ref": {"max_tokens_per_micro_batch": 256},
        "reward": {"functions": [{"path": "rlhf.rewards.arith:exact_match"}], "num_workers": 0},
        "rollout": {"n": 2, "max_new_tokens": 4, "cpu_kv_cache_gb": 0.05, "max_num_seqs": 16},
        "algorithm": {"adv_estimator": "gae", "kl_in_reward": True, "kl_coef": 0.01},
        "data": {"train_files": [assets["train"]], "val_files": [assets["val"]],
                 "max_prompt_length": 24, "train_batch_size": 4, "val_batch_size": 8},
        "trainer": {"output_dir": str(output_dir), "total_steps": 3, "val_every": 0,
                    "device": "cpu", "ranks_per_node": 2, "ray_metrics": False,
                    "experiment_name": output_dir.name},
        "sft": {"train_files": [assets["sft"]], "batch_size": 8, "total_steps": 4,
                "log_every": 1, "max_tokens_per_micro_batch": 256, "optim": {"lr": 1.0e-3}},
    }
    return config_from_dict(merge(tree, sections))
