"""Data parallelism of the worker roles without Ray: two DP ranks, each updating its rows of
the driver's batch split, take the same steps as one rank with every sample."""

import sys
from pathlib import Path

import pytest
import torch

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # spawned ranks import this module by name
    sys.path.insert(0, _ROOT)

from rlhf.data.batch import Batch  # noqa: E402
from rlhf.parallel.launch import run_distributed  # noqa: E402
from rlhf.parallel.mesh import ProcessGroupCache  # noqa: E402
from rlhf.trainer.step_splits import StepSplits  # noqa: E402
from tests.unit.test_worker_roles import TOL, context, folders, make_config, rl_batch, world  # noqa: E402,F401
from workers.actor import ActorWorker  # noqa: E402
from workers.critic import CriticWorker  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def split_call(method, batch, split, rank):
    """What the dispatcher does for DP group `rank`: its rows of the plan, with its GroupBatches."""
    return method(batch.select(list(split.rows[rank])), split=split.groups[rank])


def _train_both(rank, world_size, policy, batch):
    """Actor and critic colocated over `world_size` DP ranks: update on this rank's rows of the
    driver's batch split (two mini-batches), then the new log-probs and values of the whole batch."""
    cache = ProcessGroupCache()
    cfg = make_config(policy, ranks=world_size, actor={"ppo_mini_batch_size": 4},
                      algorithm={"ppo_epochs": 2, "loss_agg_mode": "seq-mean-token-mean"})
    actor = ActorWorker(context(cache, "actor", rank, world_size), config=cfg)
    critic = CriticWorker(context(cache, "critic", rank, world_size), config=cfg)
    step = StepSplits(cfg, {"actor": world_size, "critic": world_size}, batch)
    splits = {key: step.update(key) for key in ("actor", "critic")}
    if world_size > 1:  # no rank guesses what the others will do
        with pytest.raises(ValueError, match="needs the driver's batch split"):
            actor.update_actor(batch.chunk(world_size)[rank])
    metrics = {**split_call(actor.update_actor, batch, splits["actor"], rank),
               **split_call(critic.update_critic, batch, splits["critic"], rank)}
    return (metrics, actor.compute_log_prob(batch)["old_log_probs"],
            critic.compute_values(batch)["values"])


def test_data_parallel_update_equals_single_rank(folders, world):
    """Two DP ranks with half the samples each take the same steps as one rank with all: the
    losses are normalised by global counts and the gradients summed over DP."""
    policy, _ = folders
    cfg = make_config(policy)
    actor = ActorWorker(context(world, "actor"), config=cfg)
    batch, _ = rl_batch(actor, seed=7, mask_every=4)
    values = CriticWorker(context(world, "critic"), config=cfg).compute_values(batch)["values"]
    batch = batch.union(Batch({"values": values}))
    single = _train_both(0, 1, policy, batch)
    two = run_distributed(_train_both, 2, policy, batch, timeout_s=150)
    for rank_result in two:
        assert rank_result[0] == pytest.approx(single[0], abs=1e-5, rel=1e-4)
        torch.testing.assert_close(rank_result[1].values, single[1].values, atol=TOL, rtol=0)
        torch.testing.assert_close(rank_result[2].values, single[2].values, atol=TOL, rtol=0)
    assert not torch.allclose(single[1].values, batch["old_log_probs"].values, atol=1e-4)


def test_cost_model_split_trains_like_the_token_budget(folders, world):
    """Another cut of the same mini-batch into micro-batches (the cost model's: one micro-batch
    past the 24-token budget) takes the same optimizer step: losses are normalised globally."""
    import dataclasses

    from rlhf.config import TrainerConfig
    from rlhf.data.cost_model import PhaseCost, RoleCost, StageCost

    policy, _ = folders
    results = []
    for mode in ("token_budget", "cost_model"):
        cfg = make_config(policy)
        cfg = dataclasses.replace(cfg, trainer=TrainerConfig(micro_batching=mode))
        actor = ActorWorker(context(world, "actor"), config=cfg)
        batch, _ = rl_batch(actor, seed=7)
        # a constant per micro-batch and memory of the longest sequence: one micro-batch
        stage = StageCost({"const": 1.0, "tokens": 1e-6}, {"max_sq": 1.0})
        models = {"actor": RoleCost({}, {p: PhaseCost((stage,), {})
                                         for p in ("forward", "forward_backward")})}
        split = StepSplits(cfg, {"actor": 1}, batch, cost_models=models).update("actor")
        results.append((len(split.groups[0].mini_batches[0]),
                        split_call(actor.update_actor, batch, split, 0),
                        actor.compute_log_prob(batch)["old_log_probs"]))
    (budget_mbs, budget, budget_lp), (cost_mbs, cost, cost_lp) = results
    assert cost_mbs == 1 < budget_mbs
    assert cost["actor/pg_loss"] == pytest.approx(budget["actor/pg_loss"], abs=1e-5, rel=1e-4)
    torch.testing.assert_close(cost_lp.values, budget_lp.values, atol=TOL, rtol=0)
