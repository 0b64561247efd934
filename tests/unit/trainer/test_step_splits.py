"""The driver's batch splits of a step: shared between calls that split alike, the same optimizer-step
samples at every DP size, and the one decision whether old log-probs get their own pass."""

import dataclasses

import pytest
import torch

from rlhf.algorithms import algorithm_needs
from rlhf.config import (
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    ForwardRoleConfig,
    JobConfig,
    RolloutConfig,
    TrainerConfig,
    TrainRoleConfig,
)
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.trainer.step_splits import StepSplits, fuse_old_log_probs


def make_batch(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    plens = torch.randint(2, 9, (n,), generator=gen).tolist()
    rlens = torch.randint(0, 30, (n,), generator=gen).tolist()
    return Batch({"prompt_ids": Ragged.from_list([[1] * k for k in plens], dtype=torch.int64),
                  "response_ids": Ragged.from_list([[2] * k for k in rlens], dtype=torch.int64)})


def config(*, epochs=1, actor_mini=4, train_batch=4, kl_in_reward=False, adv="grpo", warmup=0,
           actor_mbs=None, ref_budget=64):
    return dataclasses.replace(
        JobConfig(),
        actor=TrainRoleConfig(max_tokens_per_micro_batch=64, ppo_mini_batch_size=actor_mini,
                              micro_batch_size=actor_mbs),
        critic=CriticConfig(ppo_mini_batch_size=actor_mini),
        ref=ForwardRoleConfig(max_tokens_per_micro_batch=ref_budget),
        data=dataclasses.replace(DataConfig(), train_batch_size=train_batch),
        rollout=RolloutConfig(n=2),
        algorithm=AlgorithmConfig(ppo_epochs=epochs, kl_in_reward=kl_in_reward, adv_estimator=adv,
                                  use_kl_loss=not kl_in_reward),
        trainer=TrainerConfig(critic_warmup=warmup))


def fused(cfg, step):
    return fuse_old_log_probs(cfg, algorithm_needs(cfg), step=step)


def test_fused_old_log_probs_only_on_policy_without_kl_in_reward():
    assert fused(config(), 1)
    assert not fused(config(epochs=2), 1)
    assert not fused(config(actor_mini=2), 1)  # two mini-batches per step
    assert not fused(config(kl_in_reward=True), 1)
    # gae trains a critic: during its warm-up the actor does not update, so nothing fuses
    assert not fused(config(adv="gae", warmup=2), 2)
    assert fused(config(adv="gae", warmup=2), 3)


def test_calls_that_plan_alike_share_one_plan():
    batch = make_batch(8)
    splits = StepSplits(config(), {"actor": 2, "ref": 2}, batch)
    assert splits.forward("actor") is splits.forward("ref")  # same dp, budget and no sample cap
    assert splits.update("actor") is not splits.forward("actor")
    assert splits.update("actor").num_mini_batches == 1
    capped = StepSplits(config(actor_mbs=2), {"actor": 2, "ref": 2}, batch)
    assert capped.forward("actor") is not capped.forward("ref")
    assert all(len(mb) <= 2 for g in capped.forward("actor").groups
               for mb in g.mini_batches[0])
    other_dp = StepSplits(config(), {"actor": 2, "ref": 4}, batch)
    assert other_dp.forward("ref").dp == 4 and other_dp.forward("actor").dp == 2
    assert splits.imbalance >= 1.0


def test_update_plans_step_on_the_same_samples_at_every_dp():
    cfg, batch = config(actor_mini=2), make_batch(16, seed=3)  # 4 samples per step, 4 steps
    splits = {dp: StepSplits(cfg, {"actor": dp}, batch).update("actor") for dp in (1, 2, 4)}
    for k in range(4):
        assert {tuple(p.mini_batch_rows(k)) for p in splits.values()} == \
            {tuple(range(4 * k, 4 * k + 4))}
    with pytest.raises(ValueError, match=r"actor\.ppo_mini_batch_size \* rollout\.n = 2 samples "
                                         r"per optimizer step cannot give each of the actor's 4"):
        StepSplits(config(actor_mini=1), {"actor": 4}, batch).update("actor")
    with pytest.raises(ValueError, match=r"send a multiple of 8"):
        StepSplits(config(actor_mini=4), {"actor": 2}, batch[:12]).update("actor")


def test_cost_model_splits_each_pass_by_its_phase_and_needs_the_models():
    from rlhf.data.cost_model import PhaseCost, RoleCost, StageCost

    cfg = dataclasses.replace(config(actor_mini=2, train_batch=4),
                              trainer=TrainerConfig(micro_batching="cost_model"))
    batch = make_batch(8)
    with pytest.raises(ValueError, match="rlhf profile"):
        StepSplits(cfg, {"actor": 2}, batch)
    # A forward whose per-micro-batch constant dominates and whose memory is that of its
    # longest sequence (one micro-batch per group, past the token budget), and an update
    # whose quadratic memory term allows few tokens per micro-batch.
    forward = PhaseCost((StageCost({"const": 1.0, "tokens": 1e-6}, {"max_sq": 1.0}),), {})
    update = PhaseCost((StageCost({"const": 1e-6, "tokens": 1e-3}, {"sum_sq": 1.0}),), {})
    models = {"actor": RoleCost({}, {"forward": forward, "forward_backward": update})}
    splits = StepSplits(cfg, {"actor": 2}, batch, cost_models=models)
    fwd, upd = splits.forward("actor"), splits.update("actor")
    assert [len(g.mini_batches[0]) for g in fwd.groups] == [1, 1]
    assert sum(fwd.groups[0].token_counts[0]) + sum(fwd.groups[1].token_counts[0]) > 2 * 64
    limit = 64 * 64  # memory of one sequence filling the budget: max_tokens_per_micro_batch
    lengths = splits.lengths
    for rows, group in zip(upd.rows, upd.groups):
        for mini in group.mini_batches:
            for mb in mini:
                assert sum(lengths[rows[i]] ** 2 for i in mb) <= limit
    assert upd.num_mini_batches == 2 and sorted(r for g in upd.rows for r in g) == list(range(8))
    # The gain a plan must predict over the token budget's: its phase's fit error on the grid.
    from rlhf.trainer.step_splits import cost_plan
    fitted = RoleCost({}, models["actor"].phases,
                      {"forward_backward": {"time_median_abs_rel_error": 0.2}})
    assert cost_plan(cfg.actor, fitted, "forward_backward").margin == 0.2
    assert cost_plan(cfg.actor, fitted, "forward").margin == 0.0


def test_auto_pipeline_schedule_follows_the_predicted_step():
    """trainer.pipeline_schedule=auto runs the interleaved schedule where the cost model
    predicts it faster (free messages: a smaller bubble) and 1F1B where its extra messages
    cost more than the bubble saves."""
    from rlhf.config import ParallelConfig
    from rlhf.data.cost_model import PhaseCost, RoleCost, StageCost
    from rlhf.trainer.step_splits import choose_schedules

    base = config(actor_mini=2, train_batch=4)
    actor = dataclasses.replace(base.actor, parallel=ParallelConfig(pp=2, vpp=2))
    cfg = dataclasses.replace(base, actor=actor, trainer=TrainerConfig(
        micro_batching="cost_model", pipeline_schedule="auto"))
    stage = StageCost({"const": 1e-4, "tokens": 1e-3}, {"tokens": 1.0})
    chosen = {}
    for message in (0.0, 0.05):
        phases = {ph: PhaseCost((stage, stage), {"const": message})
                  for ph in ("forward", "forward_backward")}
        picked, predicted = choose_schedules(cfg, {"actor": RoleCost({}, phases)}, {"actor": 1})
        seconds = predicted["actor"]
        assert set(seconds) == {1, 2} and seconds[1] != seconds[2]
        chosen[message] = picked.actor.parallel.vpp
        assert chosen[message] == min(seconds, key=seconds.get)
        assert picked.actor.parallel.pp == 2 and picked.ref == cfg.ref
    assert chosen == {0.0: 2, 0.05: 1}
    fixed = dataclasses.replace(cfg, trainer=TrainerConfig(micro_batching="cost_model"))
    assert choose_schedules(fixed, {"actor": RoleCost({}, phases)}, {"actor": 1}) == (fixed, {})
    with pytest.raises(ValueError, match="pipeline_schedule=auto.*micro_batching=cost_model"):
        TrainerConfig(pipeline_schedule="auto")
