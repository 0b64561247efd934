"""A job scored by a reward model alone (reward.model_path, no reward.functions) trains."""

import pytest
import torch
from transformers import LlamaForSequenceClassification

from rlhf.preflight import preflight
from rlhf.trainer.jobs import run_train
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(400)


def test_a_reward_model_only_job_trains_on_the_models_scores(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    torch.manual_seed(0)
    LlamaForSequenceClassification.from_pretrained(
        assets["model"], num_labels=1, dtype=torch.float32).save_pretrained(tmp_path / "rm")
    cfg = job_config(
        assets, tmp_path / "rm-run",
        algorithm={"adv_estimator": "grpo", "kl_in_reward": False},
        reward={"functions": [], "model_path": str(tmp_path / "rm"), "model_weight": 2.0,
                "max_tokens_per_micro_batch": 256},
        trainer={"total_steps": 2, "ranks_per_node": 1})  # scoring does not need two ranks
    preflight(cfg, command="train", ray_address="already-running")
    records = run_train(cfg, progress=False)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["reward/rm_mean"] != 0.0
        assert r["reward/mean"] == pytest.approx(2.0 * r["reward/rm_mean"], rel=1e-5)
        assert not any(k.startswith("reward/exact_match") for k in r)
    assert (tmp_path / "rm-run" / "hf_model" / "config.json").is_file()
