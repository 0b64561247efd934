"""GRPO (no critic, KL loss) end to end, and a reward function that fails mid-run: the job
stops with a message naming the function, the last checkpoint intact. Both jobs run on one
set of worker groups, the second from a checkpoint of the groups' start."""

import json
from pathlib import Path

import pytest

from rlhf.errors import RLHFError
from rlhf.trainer.checkpoint import CheckpointManager
from rlhf.trainer.jobs import RoleGroups, job_workers, load_tokenizer
from rlhf.trainer.metrics import read_metrics
from rlhf.trainer.ppo import PPOTrainer
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(300)

REWARD = '''
def exact_or_explode(*, prompt, response, ground_truth, extra):
    if extra.get("explode"):
        raise ValueError("reward backend unreachable")
    return float(response.strip() == str(ground_truth))
'''
GRPO = {"adv_estimator": "grpo", "kl_in_reward": False, "use_kl_loss": True,
        "kl_loss_coef": 0.01}


def explosive_train_file(src: str, dst: Path, *, first_bad: int) -> str:
    """The rows of `src`, the ones from `first_bad` on marked to make the reward fail."""
    rows = [json.loads(line) for line in Path(src).read_text().splitlines()]
    for i, row in enumerate(rows):
        row["explode"] = i >= first_bad
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(dst)


@pytest.fixture(scope="module")
def groups(ray_cluster, tmp_path_factory):
    """The GRPO job's worker groups (actor with its rollout, reference) and a checkpoint of
    their start: each test restores it, so its job starts as on fresh groups. The mini-batch
    size reaches the workers in the driver's batch split, so the tests' configs may differ
    in it; everything else the workers read is the same."""
    root = tmp_path_factory.mktemp("grpo")
    assets = make_assets(root)
    cfg = job_config(assets, root / "start", algorithm=GRPO)
    roles, role_configs = job_workers(cfg)
    groups = RoleGroups(cfg, roles, job_name="grpo-test", role_configs=role_configs)
    try:
        start = str(root / "start-ckpt")
        groups.views["actor"].save_checkpoint(start)
        yield groups, assets, start
    finally:
        groups.shutdown()


def fit(groups, cfg):
    groups, _, start = groups
    groups.views["actor"].load_checkpoint(start)
    return PPOTrainer(cfg, groups.views, tokenizer=load_tokenizer(cfg.model.path),
                      job_name="grpo-test", progress=False).fit()


def test_grpo_steps_then_a_failing_reward_stops_the_job(groups, tmp_path):
    assets = groups[1]
    (tmp_path / "reward.py").write_text(REWARD)
    # Unshuffled batches of 4: steps 1 and 2 see rows 0-7, step 3 meets row 8.
    train = explosive_train_file(assets["train"], tmp_path / "train.jsonl", first_bad=8)
    cfg = job_config(
        assets, tmp_path / "grpo-run", algorithm=GRPO,
        reward={"functions": [{"path": f"{tmp_path / 'reward.py'}:exact_or_explode"}]},
        data={"train_files": [train], "shuffle": False},
        trainer={"total_steps": 3, "save_every": 1, "val_every": 2})
    with pytest.raises(RLHFError, match="exact_or_explode") as info:
        fit(groups, cfg)
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


def test_on_policy_grpo_takes_old_log_probs_from_the_update(groups, tmp_path):
    """One PPO epoch of one mini-batch and no KL in the reward: no separate old-log-prob pass,
    yet the metrics that read old log-probs (log-prob gap, entropy, KL to the reference) stay."""
    cfg = job_config(groups[1], tmp_path / "fused-run", actor={"ppo_mini_batch_size": 4},
                     algorithm=GRPO, trainer={"total_steps": 2, "save_every": 0})
    fit(groups, cfg)
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


# A verl reward file, unchanged; it fails the job unless verl's arguments reach it intact.
VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "arith" or extra_info["split"] not in ("train", "test"):
        raise ValueError(f"verl arguments lost: {data_source!r}, {extra_info!r}")
    return {"score": float(solution_str.strip() == ground_truth), "verl_rows": 1.0}
'''


def verl_parquet(src: str, dst: Path, split: str) -> str:
    """The rows of `src` in verl's layout: a chat prompt, the answer under reward_model."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in Path(src).read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist([
        {"data_source": row["data_source"], "ability": "math",
         "prompt": [{"role": "user", "content": row["prompt"]}],
         "reward_model": {"style": "rule", "ground_truth": row["ground_truth"]},
         "extra_info": {"split": split, "index": i}} for i, row in enumerate(rows)]), dst)
    return str(dst)


def test_verl_rows_and_reward_run_unchanged_with_sampled_validation(groups, tmp_path):
    assets = groups[1]
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    cfg = job_config(
        assets, tmp_path / "verl-run", algorithm=GRPO,
        reward={"functions": [{"path": f"{tmp_path / 'verl_reward.py'}:compute_score"}]},
        data={"train_files": [verl_parquet(assets["train"], tmp_path / "train.parquet", "train")],
              "val_files": [verl_parquet(assets["val"], tmp_path / "val.parquet", "test")],
              "ground_truth_key": "reward_model.ground_truth"},
        trainer={"total_steps": 3, "save_every": 0, "val_every": 3, "val_before_train": False,
                 "val_sampling": {"n": 4, "temperature": 1.0}})
    fit(groups, cfg)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["reward/compute_score/verl_rows"] == 1.0 for r in records)
    val = records[-1]
    assert val["val/accuracy"] == val["val/reward_mean@greedy"]
    passes = [val[f"val/pass@{k}"] for k in (1, 2, 4)]
    assert 0.0 <= passes[0] <= passes[1] <= passes[2] <= 1.0
    assert val["val/pass@1"] == pytest.approx(val["val/reward_mean@sampled"])  # 0/1 rewards
