"""GRPO (no critic, KL loss) end to end through `run_train`, and a reward function that fails
mid-run: the job stops with a message naming the function, the last checkpoint intact."""

import json
from pathlib import Path

import pytest

from rlhf.errors import RLHFError
from rlhf.trainer.checkpoint import CheckpointManager
from rlhf.trainer.jobs import run_train
from rlhf.trainer.metrics import read_metrics
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(300)

REWARD = '''
def exact_or_explode(*, prompt, response, ground_truth, extra):
    if extra.get("explode"):
        raise ValueError("reward backend unreachable")
    return float(response.strip() == str(ground_truth))
'''


def explosive_train_file(src: str, dst: Path, *, first_bad: int) -> str:
    """The rows of `src`, the ones from `first_bad` on marked to make the reward fail."""
    rows = [json.loads(line) for line in Path(src).read_text().splitlines()]
    for i, row in enumerate(rows):
        row["explode"] = i >= first_bad
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(dst)


def test_grpo_steps_then_a_failing_reward_stops_the_job(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    (tmp_path / "reward.py").write_text(REWARD)
    # Unshuffled batches of 4: steps 1 and 2 see rows 0-7, step 3 meets row 8.
    train = explosive_train_file(assets["train"], tmp_path / "train.jsonl", first_bad=8)
    cfg = job_config(
        assets, tmp_path / "grpo-run",
        algorithm={"adv_estimator": "grpo", "kl_in_reward": False, "use_kl_loss": True,
                   "kl_loss_coef": 0.01},
        reward={"functions": [{"path": f"{tmp_path / 'reward.py'}:exact_or_explode"}]},
        data={"train_files": [train], "shuffle": False},
        trainer={"total_steps": 3, "save_every": 1, "val_every": 2})
    with pytest.raises(RLHFError, match="exact_or_explode") as info:
        run_train(cfg, progress=False)
    assert "reward backend unreachable" in str(info.value)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert {"actor/pg_loss", "actor/kl_loss", "actor/kl_ref", "actor/approx_kl",
                "reward/mean", "timing/old_log_prob"} <= set(r)
        assert not any(k.startswith("critic/") for k in r)
    assert "val/accuracy" in records[2]
    ckpt = CheckpointManager(cfg.trainer.output_dir)
    assert [s for s, _ in ckpt.checkpoints()] == [1, 2]
    assert ckpt.load_state(ckpt.latest())["step"] == 2
    assert sorted(p.name for p in ckpt.latest().iterdir()) == ["actor", "manifest.json",
                                                               "trainer_state.pt"]
    assert not list(ckpt.root.glob(".step_*"))


def test_on_policy_grpo_takes_old_log_probs_from_the_update(ray_cluster, tmp_path):
    """One PPO epoch of one mini-batch and no KL in the reward: no separate old-log-prob pass,
    yet the metrics that read old log-probs (log-prob gap, entropy, KL to the reference) stay."""
    assets = make_assets(tmp_path)
    cfg = job_config(
        assets, tmp_path / "fused-run", actor={"ppo_mini_batch_size": 4},
        algorithm={"adv_estimator": "grpo", "kl_in_reward": False, "use_kl_loss": True,
                   "kl_loss_coef": 0.01},
        trainer={"total_steps": 2, "save_every": 0})
    run_train(cfg, progress=False)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert "timing/old_log_prob" not in r
        assert {"rollout/logprob_gap_mean", "rollout/entropy", "actor/kl_ref",
                "actor/approx_kl", "timing/update_actor"} <= set(r)
        assert abs(r["actor/approx_kl"]) < 1e-6 and r["actor/clipfrac"] == 0.0  # on-policy
    # vLLM samples from the policy the trainer scores: the gap is rounding only
    assert records[0]["rollout/logprob_gap_mean"] < 1e-3
    assert records[0]["actor/kl_ref"] == 0.0 and records[1]["actor/kl_ref"] != 0.0
