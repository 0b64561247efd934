"""Weight sync from a pipeline-parallel actor (pp=2 on two ranks): every stage contributes its
layers, and both rollout replicas end up with the trained policy."""

import pytest

from rlhf.data.batch import Batch
from rlhf.rollout import logprob_gap
from tests.ray.rollout_helpers import (
    GAP_TOL,
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
    return make_policy(tmp_path_factory.mktemp("rollout-pp"))


@pytest.fixture(scope="module")
def actor(ray_cluster, policy):
    cfg = rollout_config(policy, ranks=2, pp=2, n=N)
    yield from actor_group(cfg, "rollout-pp")


def test_sync_from_two_pipeline_stages(actor, policy, tmp_path):
    batch4 = prompts(4, seed=2)
    first = actor.generate(Batch({"prompt_ids": batch4["prompt_ids"]}, meta={"seed": 1}))
    before = actor.generate(batch4, greedy=True)["response_ids"]
    actor.update_actor(ppo_batch(actor, first, batch4, N))

    sync = actor.sync_weights()
    assert sync["sync/skipped"] == 0.0 and sync["sync/bytes"] > 1e6
    fresh = actor.generate(Batch({"prompt_ids": batch4["prompt_ids"]}, meta={"seed": 2}))
    scored = ppo_batch(actor, fresh, batch4, N)
    gap = logprob_gap(scored["old_log_probs"], scored["rollout_log_probs"])
    assert gap["rollout/logprob_gap_max"] < GAP_TOL, gap

    folder = actor.export_hf(str(tmp_path / "trained"), policy)[0]
    greedy = actor.generate(batch4, greedy=True)["response_ids"]
    assert not greedy.equal(before), "training did not change the greedy responses"
    assert assert_greedy_equal(greedy, hf_greedy(folder, batch4)) >= 8
