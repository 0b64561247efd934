"""The first PPO step is the same whatever the actor's layout: on 4 ranks, dp=4, tp=2, pp=2
and tp=2 x pp=2 give the same old log-probs, losses, grad norm and updated log-probs for the
same batch (driver-side GRPO advantages from fixed scores; two mini-batches, each balanced
over the DP groups by the driver's batch split, so dp 4, 2 and 1 step on the same samples),
and so does the one-mini-batch step, its old log-probs fused into the update. At pp=2 the
step cut by a cost model (trainer.micro_batching=cost_model, the file `rlhf train` loads,
its fingerprint checked) runs uneven micro-batches through the pipeline to the same step."""

import pytest
import torch

from rlhf.controller import ResourcePool, WorkerGroup
from rlhf.data.batch import Batch
from rlhf.data.cost_model import CostModelFile, PhaseCost, RoleCost, StageCost
from rlhf.data.ragged import Ragged
from rlhf.plan import profile as prof
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


def step(group, cfg, *, fused=False, cost_models=None):
    """Old log-probs, the update's metrics and the log-probs after it, for `cfg`'s mini-batch
    size (the driver's batch split; the group's own config is not read for it); `fused`: the
    update takes old log-probs from its own first forward (the compute_log_prob call only
    checks them); `cost_models`: cut by them (trainer.micro_batching=cost_model)."""
    batch = first_batch()
    splits = StepSplits(cfg, {"actor": group.role_views()["actor"].layout.dp}, batch,
                        cost_models=cost_models)
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


# The one-mini-batch step's layouts: the separate pass at dp=4 and the update's own first
# forward at tp=2 x pp=2 (dp=1) and pp=2 (dp=2).
FUSED = {"tp1": False, "tp2xpp2": True, "pp2": True}


@pytest.fixture(scope="module")
def steps(ray_cluster, tmp_path_factory):
    """One 4-rank actor group per layout takes the two-mini-batch step, then, restored from
    a checkpoint of its starting weights and optimizer, the one-mini-batch step: one group
    start per layout, both steps from the same start as on fresh groups."""
    root = tmp_path_factory.mktemp("layouts")
    assets = make_assets(root)
    results = {"two": {}, "one": {}, "cost": {}}
    for name, plan in LAYOUTS.items():
        cfgs = {mini: job_config(assets, root / f"{name}-{mini}",
                                 actor={"parallel": plan, "ppo_mini_batch_size": size},
                                 algorithm={"adv_estimator": "grpo", "kl_in_reward": False},
                                 trainer={"ranks_per_node": 4})
                for mini, size in (("two", 2), ("one", 4))}
        pool = ResourcePool(f"layouts-{name}", ranks_per_node=4, use_gpu=False)
        group = WorkerGroup(pool, {"actor": (ActorWorker, {"config": cfgs["two"]})},
                            job_name=f"lay-{name}")
        try:
            start = str(root / f"{name}-start")
            group.save_checkpoint(start)
            results["two"][name] = step(group, cfgs["two"])
            if name in FUSED:
                group.load_checkpoint(start)
                results["one"][name] = step(group, cfgs["one"], fused=FUSED[name])
            if name == "pp2":
                cost_cfg = job_config(assets, root / "pp2-cost", actor={
                    "parallel": plan, "ppo_mini_batch_size": 2},
                    algorithm={"adv_estimator": "grpo", "kl_in_reward": False},
                    trainer={"ranks_per_node": 4, "micro_batching": "cost_model"})
                models = write_cost_models(cost_cfg)
                group.load_checkpoint(start)
                results["cost"]["tp1"] = results["two"]["tp1"]
                results["cost"][name] = step(group, cost_cfg, cost_models=models)
                results["cost_micro_batches"] = [
                    micro_batch_count(s) for s in (
                        StepSplits(cost_cfg, {"actor": 2}, first_batch(), cost_models=models),
                        StepSplits(cfgs["two"], {"actor": 2}, first_batch()))]
        finally:
            group.shutdown()
    return results


def micro_batch_count(splits):
    """Micro-batches over every group and mini-batch of the step's forward and update."""
    return sum(len(mini) for split in (splits.forward("actor"), splits.update("actor"))
               for group in split.groups for mini in group.mini_batches)


def write_cost_models(cfg):
    """A two-stage cost model of the actor in the job's cost model file, then loaded as
    `rlhf train` loads it: time linear in tokens (many small micro-batches fill a pipeline
    best), free messages."""
    stage = StageCost({"const": 1e-5, "tokens": 1e-3}, {"tokens": 1.0})
    phases = {ph: PhaseCost((stage, stage), {}) for ph in ("forward", "forward_backward")}
    fingerprints = prof.job_fingerprints(cfg)
    CostModelFile({key: RoleCost(fp, phases) for key, (_, fp) in fingerprints.items()}).save(
        prof.cost_model_path(cfg))
    return prof.load_cost_models(cfg)


def check_same_step(results):
    ref_lp, ref_metrics, ref_after = results["tp1"]
    assert not torch.allclose(ref_after.values, ref_lp.values, atol=1e-3)  # it trained
    for name, (lp, metrics, after) in results.items():
        torch.testing.assert_close(lp.values, ref_lp.values, atol=1e-5, rtol=0, msg=name)
        for key in METRICS:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), \
                (name, key)
        torch.testing.assert_close(after.values, ref_after.values,
                                   atol=1e-4, rtol=0, msg=name)


def test_first_step_is_the_same_for_every_actor_layout(steps):
    assert sorted(steps["two"]) == sorted(LAYOUTS)
    check_same_step(steps["two"])


def test_fused_old_log_probs_give_the_same_step_for_every_layout(steps):
    """One mini-batch: the separate pass at dp=4 and the update's own first forward at
    tp=2 x pp=2 (dp=1) and pp=2 (dp=2) take the same step."""
    assert sorted(steps["one"]) == sorted(FUSED)
    check_same_step(steps["one"])


def test_cost_model_cut_gives_the_same_step_at_pp2(steps):
    """More micro-batches than the token budget's (one per group and pass; a prompt's
    samples stay together), through the pipeline: the same step as tp=1's."""
    cost, budget = steps["cost_micro_batches"]
    assert cost > budget
    check_same_step(steps["cost"])
