"""Four ranks colocating the actor (tp=2 with sequence parallelism, dp=2), critic (dp=4),
reference (dp=4) and reward model (dp=4), driven through their WorkerGroup role views and
checked against single-process transformers / unsharded references."""

import math

import pytest
import torch
from transformers import LlamaForSequenceClassification

from rlhf.config import ParallelConfig
from rlhf.controller import Layout, ResourcePool, WorkerError, WorkerGroup
from rlhf.data.batch import Batch
from rlhf.models.config import ModelArgs
from rlhf.models.hf_io import load_hf_weights
from rlhf.models.transformer import ValueModel
from rlhf.trainer.step_splits import StepSplits
from tests.unit.test_worker_roles import (
    ACTOR_KEYS,
    CRITIC_KEYS,
    TEMPERATURE,
    hf_token_stats,
    make_batch,
    make_config,
    make_folders,
    per_token,
)
from workers.actor import ActorWorker
from workers.critic import CriticWorker
from workers.reference import ReferenceWorker
from workers.reward_model import RewardModelWorker

pytestmark = pytest.mark.timeout(180)

JOB = "workers-test"
TOL = 1e-5
LAYOUTS = {"actor": Layout(dp=2, tp=2), "critic": Layout(dp=4), "ref": Layout(dp=4),
           "reward": Layout(dp=4)}


def job_config(policy, rm, *, ranks=4, actor_tp=2):
    return make_config(
        policy, ranks=ranks, reward_model=rm, rollout={"n": 2},
        actor={"parallel": ParallelConfig(tp=actor_tp, sequence_parallel=actor_tp > 1),
               "ppo_mini_batch_size": 2},
        critic={"ppo_mini_batch_size": 2}, algorithm={"use_kl_loss": True})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return make_folders(tmp_path_factory.mktemp("workers"))


@pytest.fixture(scope="module")
def views(ray_cluster, folders):
    cfg = job_config(*folders)
    roles = {"actor": (ActorWorker, {"config": cfg}), "critic": (CriticWorker, {"config": cfg}),
             "ref": (ReferenceWorker, {"config": cfg}),
             "reward": (RewardModelWorker, {"config": cfg})}
    group = WorkerGroup(ResourcePool("workers-pool", ranks_per_node=4, use_gpu=False), roles,
                        job_name=JOB)
    yield group.role_views()
    group.shutdown()


@pytest.fixture(scope="module")
def batch7():
    return make_batch(n=7, seed=11)  # 7 samples split 4+3 and 2+2+2+1; sample 1 is empty


@pytest.fixture(scope="module")
def policy_stats(folders, batch7):
    return hf_token_stats(folders[0], batch7, TEMPERATURE)


def assert_rows_close(got, want):
    assert len(got) == len(want)
    for i, row in enumerate(want):
        torch.testing.assert_close(got[i], row, atol=TOL, rtol=0, msg=f"sample {i}")


def test_each_role_has_its_own_layout(views):
    assert {name: view.layout for name, view in views.items()} == LAYOUTS


def splits_of(views, folders, batch):
    return StepSplits(job_config(*folders), {k: v.layout.dp for k, v in views.items()}, batch)


def test_actor_log_probs_and_entropy_match_transformers(views, folders, batch7, policy_stats):
    out = views["actor"].compute_log_prob(batch7)
    assert out.keys() == ["old_log_probs", "entropy"] and len(out) == 7
    assert_rows_close(out["old_log_probs"], [logp for logp, _ in policy_stats])
    assert_rows_close(out["entropy"], [ent for _, ent in policy_stats])
    # the driver's batch split reorders rows over the DP groups; results come back in driver order
    split = splits_of(views, folders, batch7).forward("actor")
    assert [sorted(r) for r in split.rows] != [[0, 1, 2, 3], [4, 5, 6]]
    by_split = views["actor"].compute_log_prob(batch7, split=split)
    assert_rows_close(by_split["old_log_probs"], [logp for logp, _ in policy_stats])
    assert_rows_close(by_split["entropy"], [ent for _, ent in policy_stats])


def test_reference_log_probs_match_transformers(views, batch7, policy_stats):
    out = views["ref"].compute_ref_log_prob(batch7)
    assert_rows_close(out["ref_log_probs"], [logp for logp, _ in policy_stats])


def test_critic_values_match_the_unsharded_value_model(views, folders, batch7):
    policy, _ = folders
    model = ValueModel(ModelArgs.from_pretrained(policy))
    load_hf_weights(model, policy, value_head_seed=0)  # trainer.seed
    want = []
    with torch.no_grad():
        for p, r in zip(batch7["prompt_ids"].to_list(), batch7["response_ids"].to_list()):
            seq = torch.cat([p, r])
            v = model(seq, torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32),
                      len(seq))
            want.append(v[len(p) - 1:len(seq) - 1])
    assert_rows_close(views["critic"].compute_values(batch7)["values"], want)


def test_reward_scores_match_transformers(views, folders, batch7):
    hf = LlamaForSequenceClassification.from_pretrained(folders[1], dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([
            hf.score(hf.model(torch.cat([p, r])[None]).last_hidden_state)[0, -1, 0]
            for p, r in zip(batch7["prompt_ids"].to_list(), batch7["response_ids"].to_list())])
    scores = views["reward"].compute_rm_score(batch7)["rm_scores"]
    assert scores.shape == (7,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, want, atol=TOL, rtol=0)


def test_dp_groups_without_samples_return_empty_parts(views):
    batch = make_batch(n=3, seed=13)  # the 4th DP group of critic, ref and reward gets nothing
    assert views["critic"].compute_values(batch)["values"].lengths.tolist() == \
        batch["response_ids"].lengths.tolist()
    assert views["reward"].compute_rm_score(batch)["rm_scores"].shape == (3,)
    assert len(views["actor"].compute_log_prob(make_batch(n=1))) == 1


def test_updates_report_metrics_and_change_only_their_role(views, folders, batch7, policy_stats):
    batch = make_batch(n=8, seed=12)
    batch = batch.union(views["actor"].compute_log_prob(batch))
    batch = batch.union(views["critic"].compute_values(batch))
    batch = batch.union(views["ref"].compute_ref_log_prob(batch))
    lengths = batch["response_ids"].lengths
    sign = torch.tensor([1.0, -1.0] * 4).repeat_interleave(lengths)
    batch = batch.union(Batch({"advantages": per_token(batch, sign),
                               "returns": per_token(batch, sign * 0.5)}))
    splits = splits_of(views, folders, batch)
    # Queued together: every rank runs the two updates in the same order.
    pending = views["actor"].update_actor(batch, split=splits.update("actor"), blocking=False)
    critic_metrics = views["critic"].update_critic(batch, split=splits.update("critic"))
    actor_metrics = pending.get()
    assert set(actor_metrics) == ACTOR_KEYS | {"actor/kl_loss"}
    assert set(critic_metrics) == CRITIC_KEYS
    assert all(math.isfinite(v) for v in {**actor_metrics, **critic_metrics}.values())
    after = views["actor"].compute_log_prob(batch)["old_log_probs"]
    assert not torch.allclose(after.values, batch["old_log_probs"].values, atol=1e-4)
    values = views["critic"].compute_values(batch)["values"]
    assert not torch.allclose(values.values, batch["values"].values, atol=1e-4)
    # the reference policy shares the ranks but not the weights
    ref = views["ref"].compute_ref_log_prob(batch7)["ref_log_probs"]
    assert_rows_close(ref, [logp for logp, _ in policy_stats])


def test_a_failing_role_method_names_role_and_rank(views, batch7):
    with pytest.raises(WorkerError) as info:
        views["actor"].compute_log_prob(Batch({"prompt_ids": batch7["prompt_ids"]}))
    err = info.value
    assert (err.job, err.role, err.method) == (JOB, "actor", "compute_log_prob")
    assert err.rank in range(4) and f"rank {err.rank}" in str(err)
    assert "needs batch fields ['response_ids']" in str(err)
    assert len(views["actor"].compute_log_prob(batch7)) == 7  # every rank raised: still usable


def test_a_layout_larger_than_the_pool_fails_at_construction(ray_cluster, folders):
    cfg = job_config(*folders, ranks=2, actor_tp=4)
    pool = ResourcePool("workers-small-pool", ranks_per_node=2, use_gpu=False)
    try:
        with pytest.raises(WorkerError, match=r"actor\.parallel\.tp \* actor\.parallel\.pp = 4"):
            WorkerGroup(pool, {"actor": (ActorWorker, {"config": cfg})}, job_name=JOB + "-small")
    finally:
        pool.remove()
