"""The first PPO step is the same whatever the actor's layout: on 4 ranks, dp=4, tp=2, pp=2
and tp=2 x pp=2 give the same old log-probs, losses, grad norm and updated log-probs for the
same batch (driver-side GRPO advantages from fixed scores; two mini-batches, each balanced
over the DP groups by the driver's batch split, so dp 4, 2 and 1 step on the same samples)."""

import pytest
import torch

from rlhf.controller import ResourcePool, WorkerGroup
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.trainer.ppo import compute_advantages
from rlhf.trainer.step_splits import StepSplits
from tests.unit.trainer.jobs import job_config, make_assets
from workers.actor import ActorWorker

pytestmark = pytest.mark.timeout(600)  # a hang guard; a loaded machine needs room

LAYOUTS = {"tp1": {"tp": 1}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "tp2xpp2": {"tp": 2, "pp": 2}}
METRICS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/approx_kl")


def first_batch(n_prompts=4, n=2):
    torch.manual_seed(0)
    prompts = [torch.randint(5, 300, (int(k),)).tolist() for k in torch.randint(3, 9, (n_prompts,))]
    responses = [torch.randint(5, 300, (int(k),)).tolist()
                 for k in torch.randint(1, 6, (n_prompts * n,))]
    batch = Batch({"prompt_ids": Ragged.from_list(prompts, dtype=torch.int64)})
    return batch.repeat_interleave(n).union(
        Batch({"response_ids": Ragged.from_list(responses, dtype=torch.int64)}))


def step(cfg, name, *, fused=False):
    """Old log-probs, the update's metrics and the log-probs after it; `fused`: the update
    takes old log-probs from its own first forward (the compute_log_prob call only checks
    them)."""
    pool = ResourcePool(f"layouts-{name}", ranks_per_node=4, use_gpu=False)
    group = WorkerGroup(pool, {"actor": (ActorWorker, {"config": cfg})}, job_name=f"lay-{name}")
    try:
        batch = first_batch()
        splits = StepSplits(cfg, {"actor": group.role_views()["actor"].layout.dp}, batch)
        old = group.compute_log_prob(batch, split=splits.forward("actor"))
        scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
        advantages, _ = compute_advantages(batch.union(old), scores, cfg, kl_ctrl=None)
        batch = batch.union(advantages)
        assert splits.update("actor").num_mini_batches == \
            len(batch) // (cfg.actor.ppo_mini_batch_size * cfg.rollout.n)
        if fused:
            metrics, fields = group.update_actor(batch, split=splits.update("actor"))
            torch.testing.assert_close(fields["entropy"].values, old["entropy"].values,
                                       atol=1e-5, rtol=0)
            lp = fields["old_log_probs"]
        else:
            metrics = group.update_actor(batch.union(old), split=splits.update("actor"))
            lp = old["old_log_probs"]
        after = group.compute_log_prob(batch, split=splits.forward("actor"))["old_log_probs"]
        torch.testing.assert_close(lp.values, old["old_log_probs"].values, atol=1e-5, rtol=0)
        return lp, metrics, after
    finally:
        group.shutdown()


def test_first_step_is_the_same_for_every_actor_layout(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    results = {}
    for name, plan in LAYOUTS.items():
        cfg = job_config(assets, tmp_path / name, actor={"parallel": plan},
                         algorithm={"adv_estimator": "grpo", "kl_in_reward": False},
                         trainer={"ranks_per_node": 4})
        results[name] = step(cfg, name)
    ref_lp, ref_metrics, ref_after = results["tp1"]
    assert not torch.allclose(ref_after.values, ref_lp.values, atol=1e-3)  # it trained
    for name, (lp, metrics, after) in results.items():
        torch.testing.assert_close(lp.values, ref_lp.values, atol=1e-5, rtol=0, msg=name)
        for key in METRICS:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), \
                (name, key)
        torch.testing.assert_close(after.values, ref_after.values,
                                   atol=1e-4, rtol=0, msg=name)


def test_fused_old_log_probs_give_the_same_step_for_every_layout(ray_cluster, tmp_path):
    """One mini-batch: the separate pass at dp=4 and the update's own first forward at
    tp=2 x pp=2 (dp=1) and pp=2 (dp=2) take the same step."""
    assets = make_assets(tmp_path)
    results = {}
    for name, fused in (("tp1", False), ("tp2xpp2", True), ("pp2", True)):
        cfg = job_config(assets, tmp_path / name, actor={"parallel": LAYOUTS[name],
                                                         "ppo_mini_batch_size": 4},
                         algorithm={"adv_estimator": "grpo", "kl_in_reward": False},
                         trainer={"ranks_per_node": 4})
        results[name] = step(cfg, f"fused-{name}", fused=fused)
    ref_lp, ref_metrics, ref_after = results["tp1"]
    assert not torch.allclose(ref_after.values, ref_lp.values, atol=1e-3)
    for name, (lp, metrics, after) in results.items():
        torch.testing.assert_close(lp.values, ref_lp.values, atol=1e-5, rtol=0, msg=name)
        for key in METRICS:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), \
                (name, key)
        torch.testing.assert_close(after.values, ref_after.values, atol=1e-4, rtol=0, msg=name)
