"""PPO (critic, KL in reward) end to end on Ray with a tiny model: a few real steps with
validation, metrics.jsonl, checkpoints, a resume that reproduces the next steps' metrics, and
`export-hf` of a checkpoint matching the live policy."""

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import ray
import torch
from safetensors.torch import load_file

from rlhf.trainer.checkpoint import verify_checkpoint
from rlhf.trainer.jobs import (
    RoleGroups,
    checkpoint_config,
    export_checkpoint,
    job_workers,
    load_tokenizer,
)
from rlhf.trainer.metrics import read_metrics
from rlhf.trainer.ppo import PPOTrainer
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(400)

REQUIRED = {"reward/mean", "actor/pg_loss", "actor/entropy", "actor/kl_ref", "actor/approx_kl",
            "actor/grad_norm", "plan/imbalance", "timing/old_log_prob",
            "critic/value_loss", "response_length/mean", "rollout/logprob_gap_mean",
            "timing/generate", "timing/update_actor", "timing/update_critic", "timing/step",
            "throughput/tokens_per_s"}
# Wall-clock figures differ between runs; everything else must repeat exactly.
VARYING = ("timing/", "throughput/", "sync/", "rollout/seconds", "rollout/tokens_per_s",
           "memory/", "checkpoint/")


@pytest.fixture(scope="module")
def job(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    assets = make_assets(root)
    cfg = job_config(assets, root / "ppo-run",
                     trainer={"total_steps": 3, "save_every": 1, "val_every": 2,
                              "ray_metrics": True})
    roles, role_configs = job_workers(cfg)
    groups = RoleGroups(cfg, roles, job_name="ppo-test", role_configs=role_configs)
    tokenizer = load_tokenizer(cfg.model.path)
    trainer = PPOTrainer(cfg, groups.views, tokenizer=tokenizer, job_name="ppo-test",
                         progress=False)
    records = trainer.fit()
    yield cfg, groups, tokenizer, trainer, records, root
    groups.shutdown()


def comparable(record):
    return {k: v for k, v in record.items() if not k.startswith(VARYING)}


def test_steps_log_every_metric_and_validate(job):
    cfg, _, _, _, records, _ = job
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert read_metrics(cfg.trainer.output_dir) == records
    for r in records[1:]:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["throughput/tokens_per_s"] > 0
    assert [r["step"] for r in records if "val/accuracy" in r] == [0, 2, 3]
    assert records[1]["actor/kl_ref"] == 0.0 and records[3]["actor/kl_ref"] != 0.0  # ref == start
    assert "actor/kl" not in records[1]  # two quantities, two names
    assert records[1]["actor/grad_norm"] > 0 and records[1]["critic/value_loss"] > 0
    for method in ("update_actor", "update_critic", "compute_ref_log_prob", "generate"):
        assert records[1][f"memory/{method}/host_rss_gb"] > 0  # each role's calls, on the CPU


def test_metrics_are_exported_as_ray_gauges_from_a_named_actor(job):
    exporter = ray.get_actor("ppo-test/metrics")
    names = ray.get(exporter.set.remote({}))
    assert {"rlhf_reward_mean", "rlhf_actor_pg_loss", "rlhf_val_accuracy",
            "rlhf_timing_generate"} <= set(names)


def test_checkpoints_hold_roles_and_driver_state(job):
    cfg, _, _, trainer, _, _ = job
    steps = [s for s, _ in trainer.ckpt.checkpoints()]
    assert steps == [1, 2, 3]
    folder = trainer.ckpt.latest()
    assert sorted(p.name for p in folder.iterdir()) == ["actor", "critic", "manifest.json",
                                                         "trainer_state.pt"]
    assert verify_checkpoint(folder) is None
    state = trainer.ckpt.load_state(folder)
    assert state["step"] == 3 and state["loader"]["position"] == 3
    assert state["kl_ctrl"] == {"coef": cfg.algorithm.kl_coef}


def test_resume_from_a_checkpoint_reproduces_the_next_steps(job):
    cfg, groups, tokenizer, _, records, root = job
    out = root / "resumed"
    shutil.copytree(root / "ppo-run" / "checkpoints" / "step_1", out / "checkpoints" / "step_1")
    resumed_cfg = dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=str(out)))
    # The workers hold step-3 weights now: the resume must restore step 1's exactly.
    # after_step runs once per new step, after that step is logged and saved.
    seen = []
    resumed = PPOTrainer(resumed_cfg, groups.views, tokenizer=tokenizer, job_name="ppo-test",
                         progress=False).fit(lambda step: seen.append(
                             (step, (out / "checkpoints" / f"step_{step}").is_dir(),
                              len(read_metrics(out)))))
    assert [r["step"] for r in resumed] == [2, 3]
    assert seen == [(2, True, 1), (3, True, 2)]
    for got, want in zip(resumed, records[2:]):
        got, want = comparable(got), comparable(want)
        assert got.keys() == want.keys()
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_export_hf_of_a_checkpoint_matches_the_live_policy(job):
    _, _, _, trainer, _, root = job
    live = trainer.export_policy(root / "live-hf")  # the workers are at step 3 again
    ckpt_cfg, folder = checkpoint_config(trainer.ckpt.latest())
    exported = export_checkpoint(ckpt_cfg, folder, root / "exported-hf")
    a, b = load_file(live / "model.safetensors"), load_file(exported / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0, msg=name)
    assert (exported / "tokenizer.json").is_file() and (exported / "config.json").is_file()
    # The command line: a full-weight checkpoint needs no Ray (an unreachable cluster address
    # would fail any attempt to join one) and splits its files over processes.
    cli = subprocess.run(
        [sys.executable, "-m", "rlhf.cli", "export-hf", str(folder), str(root / "cli-hf"),
         "--processes", "2"], env={**os.environ, "RAY_ADDRESS": "127.0.0.1:9"},
        capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr[-2000:]
    c = load_file(root / "cli-hf" / "model.safetensors")
    assert c.keys() == b.keys() and all(torch.equal(c[k], b[k]) for k in b)
