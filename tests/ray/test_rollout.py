"""vLLM rollouts inside a two-rank actor trained with tp=2: one replica per rank, sampling
settings and seeds, the log-prob agreement with the trainer, and weight sync after training
checked against transformers loaded from the exported policy."""

import pytest
import torch

from rlhf.data.batch import Batch
from rlhf.rollout import logprob_gap
from tests.ray.rollout_helpers import (
    GAP_TOL,
    MAX_NEW,
    actor_group,
    assert_greedy_equal,
    hf_greedy,
    make_policy,
    ppo_batch,
    prompts,
    rollout_config,
)

pytestmark = [pytest.mark.timeout(400), pytest.mark.vllm]

N = 2


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return make_policy(tmp_path_factory.mktemp("rollout"))


@pytest.fixture(scope="module")
def actor(ray_cluster, policy):
    cfg = rollout_config(policy, ranks=2, tp=2, n=N)
    yield from actor_group(cfg, "rollout")


@pytest.fixture(scope="module")
def batch5():
    return prompts(5, seed=1)  # split 3 + 2 over the two replicas


def sample(actor, batch, seed):
    return actor.generate(Batch({"prompt_ids": batch["prompt_ids"]}, meta={"seed": seed}))


def test_greedy_rollout_matches_transformers_before_any_training(actor, policy, batch5):
    sync = actor.sync_weights()  # vLLM loaded model.path itself: nothing to push
    assert sync["sync/skipped"] == 1.0 and sync["sync/bytes"] == 0.0
    out = actor.generate(batch5, greedy=True)
    assert out.keys() == ["response_ids", "rollout_log_probs"] and len(out) == 5
    assert assert_greedy_equal(out["response_ids"], hf_greedy(policy, batch5)) >= 10
    metrics = out.meta["metrics"]
    assert metrics["rollout/samples"] == 5
    assert metrics["rollout/tokens_per_s"] > 0 and metrics["rollout/seconds"] > 0


def test_n_samples_per_prompt_are_prompt_major_and_seeded(actor, batch5):
    out = sample(actor, batch5, seed=7)
    assert len(out) == 5 * N
    ids, logp = out["response_ids"], out["rollout_log_probs"]
    assert ids.values.dtype == torch.int64 and logp.values.dtype == torch.float32
    assert torch.equal(ids.offsets, logp.offsets) and bool((logp.values <= 0).all())
    assert ids.lengths.max() <= MAX_NEW
    rows = [r.tolist() for r in ids.to_list()]
    assert any(rows[2 * i] != rows[2 * i + 1] for i in range(5)), "the n samples are copies"
    again = sample(actor, batch5, seed=7)
    assert again["response_ids"].equal(ids)
    torch.testing.assert_close(again["rollout_log_probs"].values, logp.values)
    other = sample(actor, batch5, seed=8)
    assert not other["response_ids"].equal(ids)
    # A prompt's samples depend on its row and the seed, not on the replica that drew them:
    # with two more prompts the split is 4 + 3, so row 3 moves from rank 1 to rank 0.
    longer = sample(actor, Batch.concat([batch5, prompts(2, seed=9)]), seed=7)
    assert longer[:5 * N]["response_ids"].equal(ids)


def test_sampler_and_trainer_log_probs_agree_when_in_sync(actor, batch5):
    rollout = sample(actor, batch5, seed=3)
    batch = ppo_batch(actor, rollout, batch5, N)
    gap = logprob_gap(batch["old_log_probs"], batch["rollout_log_probs"])
    assert gap["rollout/logprob_gap_max"] < GAP_TOL, gap


def test_training_then_sync_reaches_vllm(actor, policy, tmp_path, batch5):
    batch = ppo_batch(actor, sample(actor, batch5[:4], seed=4), batch5[:4], N)
    metrics = actor.update_actor(batch)
    assert metrics["actor/grad_norm"] > 0
    # vLLM still holds the old policy: the trainer's log-probs of fresh samples move away
    stale = ppo_batch(actor, sample(actor, batch5, seed=5), batch5, N)
    stale_gap = logprob_gap(stale["old_log_probs"], stale["rollout_log_probs"])
    assert stale_gap["rollout/logprob_gap_mean"] > 100 * GAP_TOL, stale_gap

    sync = actor.sync_weights()
    assert sync["sync/skipped"] == 0.0 and sync["sync/bytes"] > 1e6 and sync["sync/seconds"] > 0
    assert actor.sync_weights()["sync/skipped"] == 1.0  # nothing changed since
    fresh = ppo_batch(actor, sample(actor, batch5, seed=5), batch5, N)
    gap = logprob_gap(fresh["old_log_probs"], fresh["rollout_log_probs"])
    assert gap["rollout/logprob_gap_max"] < GAP_TOL, gap

    folder = actor.export_hf(str(tmp_path / "trained"), policy)[0]
    greedy = actor.generate(batch5, greedy=True)
    assert assert_greedy_equal(greedy["response_ids"], hf_greedy(folder, batch5)) >= 10


def test_loading_a_checkpoint_marks_the_rollout_stale(actor, tmp_path, batch5):
    before = actor.generate(batch5, greedy=True)["response_ids"]
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    batch = ppo_batch(actor, sample(actor, batch5[:4], seed=6), batch5[:4], N)
    actor.update_actor(batch)
    assert actor.sync_weights()["sync/skipped"] == 0.0
    assert not actor.generate(batch5, greedy=True)["response_ids"].equal(before)
    actor.load_checkpoint(str(tmp_path / "ckpt"))
    assert actor.sync_weights()["sync/skipped"] == 0.0
    assert actor.generate(batch5, greedy=True)["response_ids"].equal(before)

