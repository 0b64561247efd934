"""RolloutSource and RolloutPipeline bookkeeping against scripted fakes of the actor and the
rollout pool: which policy version samples each batch, when weights are sent, the staleness
bound and its drops, rollout log-probs as the ratio's denominator, and resume."""

import io

import pytest
import torch

from rlhf.controller.dispatch import Layout
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.trainer.metrics import SectionTimer
from rlhf.trainer.rollout_source import VERSION, RolloutPipeline, RolloutSource

N = 2  # samples per prompt


class Done:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class FakeActor:
    """The trained policy: its version is the number of updates the test made."""

    def __init__(self):
        self.version, self.sent = 0, []

    def open_weight_transfer(self, ranks):
        return ("addr", ranks)

    def join_weight_transfer(self, address, blocking=True):
        return Done(None)

    def send_weights(self, blocking=True):
        self.sent.append(self.version)
        return Done({"transfer/bytes": 8.0})


class FakeRollout:
    """Rollout ranks: an engine version, set by receive_weights from the actor's version; a
    sample's log-prob is -(engine version + 1), so a batch shows which weights sampled it."""

    layout = Layout(dp=1)

    def __init__(self, actor):
        self.actor, self.engine_version, self.generated = actor, 0, []

    def join_weight_transfer(self, address, blocking=True):
        return Done(None)

    def holds_weights(self):
        return [True]  # a resident engine (rlhf.rollout.residency): it keeps what it was sent

    def receive_weights(self, blocking=True):
        self.engine_version = self.actor.version
        return Done({"sync/bytes": 8.0, "sync/seconds": 0.01, "sync/skipped": 0.0})

    def generate(self, prompts, greedy=False, blocking=True):
        rows = len(prompts) * N
        seed = prompts.meta["seed"]
        self.generated.append((seed, self.engine_version))
        out = Batch(meta={"metrics": {"rollout/seconds": 0.02}}, fields={
            "response_ids": Ragged.from_list([[seed, i] for i in range(rows)], dtype=torch.int64),
            "rollout_log_probs": Ragged.from_list([[-(self.engine_version + 1.0)] * 2] * rows,
                                                  dtype=torch.float32)})
        return out if blocking else Done(out)


def draw(step):
    return Batch({"prompt_ids": Ragged.from_list([[step, 1], [step, 2]], dtype=torch.int64)}
                 ).with_meta(seed=step)


def make(*, max_staleness=1, total=6, old_from_rollout=True):
    actor = FakeActor()
    rollout = FakeRollout(actor)
    source = RolloutSource({"actor": actor, "rollout": rollout}, n=N)
    pipe = RolloutPipeline(source, draw, max_staleness=max_staleness, total_steps=total,
                           old_from_rollout=old_from_rollout)
    return actor, rollout, source, pipe


def train(actor, source, pipe, steps):
    """Each step takes its batch, then 'updates' the policy; returns what each step trained."""
    seen = []
    for step in steps:
        batch, metrics = pipe.next_batch(step, SectionTimer())
        seen.append({"step": step, "seed": int(batch["response_ids"].to_list()[0][0]),
                     "versions": batch[VERSION].tolist(),
                     "old": batch["old_log_probs"].values.unique().tolist(),
                     "trainer_version": source.policy_version,
                     "staleness_1": metrics["async/staleness_1"],
                     "dropped": metrics["async/dropped_samples"]})
        actor.version += 1
        source.policy_changed()
    return seen


def test_one_step_trains_batch_k_on_samples_of_version_k_minus_2_with_their_log_probs():
    actor, rollout, source, pipe = make()
    seen = train(actor, source, pipe, range(1, 7))
    for s in seen:
        k = s["step"]
        assert s["seed"] == k  # batch k holds prompts of step k
        assert s["trainer_version"] == k - 1
        sampled = max(k - 2, 0)  # one version behind the weights batch k is trained with
        assert s["versions"] == [sampled] * (2 * N)
        assert s["old"] == [-(sampled + 1.0)]  # the ratio's denominator is that version's
        assert s["staleness_1"] == (1.0 if k >= 2 else 0.0) and s["dropped"] == 0
    # batch k+1 was submitted during step k, after the weights of version k-1 were sent
    assert rollout.generated == [(k, max(k - 2, 0)) for k in range(1, 7)]
    assert actor.sent == [1, 2, 3, 4]  # version 0 is model.path, never sent
    assert pipe.pending is None  # nothing sampled past the last step


def test_bounded_staleness_sends_weights_less_often_and_stays_within_the_bound():
    actor, rollout, source, pipe = make(max_staleness=2, total=8)
    seen = train(actor, source, pipe, range(1, 9))
    assert all(s["trainer_version"] - v <= 2 for s in seen for v in s["versions"])
    assert max(s["trainer_version"] - s["versions"][0] for s in seen) == 2
    assert len(actor.sent) < 6  # one_step would send at steps 3..8


def test_samples_older_than_the_bound_are_dropped_and_counted():
    _, _, source, pipe = make(max_staleness=1)
    source.policy_version = 5
    versions = torch.tensor([5, 5, 4, 4, 3, 3])
    batch = Batch({VERSION: versions, "rollout_log_probs": Ragged.from_list(
        [[float(v)] for v in versions.tolist()], dtype=torch.float32)})
    kept, metrics = pipe.admit(batch)
    assert kept[VERSION].tolist() == [5, 5, 4, 4]
    assert metrics["async/dropped_samples"] == 2.0
    assert metrics["async/staleness_0"] == pytest.approx(1 / 3)
    assert metrics["async/staleness_1"] == pytest.approx(1 / 3)
    assert kept["old_log_probs"].values.tolist() == [5.0, 5.0, 4.0, 4.0]
    with pytest.raises(RuntimeError, match="max_staleness"):
        pipe.admit(batch.select([4, 5]))


def test_recompute_leaves_old_log_probs_to_the_trainer():
    _, _, source, pipe = make(old_from_rollout=False)
    batch, _ = pipe.next_batch(1, SectionTimer())
    assert "old_log_probs" not in batch and "rollout_log_probs" in batch


def test_resume_restores_the_in_flight_batch_and_reproduces_the_run():
    actor, rollout, source, pipe = make(total=6)
    whole = train(actor, source, pipe, range(1, 7))

    actor, rollout, source, pipe = make(total=6)
    first = train(actor, source, pipe, range(1, 4))
    buffer = io.BytesIO()
    torch.save(pipe.state_dict(), buffer)  # as the checkpoint stores it
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    assert state["pending"]["version"] == 2  # batch 4, sampled with version 2

    actor2, pool2, source2, pipe2 = make(total=6)  # fresh engines: model.path weights
    actor2.version = 3  # the checkpoint's policy
    pipe2.load_state_dict(state)
    second = train(actor2, source2, pipe2, range(4, 7))
    assert first + second == whole
    assert pool2.generated == [(5, 3), (6, 4)]  # the first send reached fresh engines


def test_checkpoints_cross_between_sync_and_async_runs():
    actor, rollout, source, pipe = make()
    pipe.load_state_dict({"policy_version": 4})  # a synchronous run's RolloutSource state
    assert source.policy_version == 4 and source.rollout_version is None and pipe.pending is None
    actor.version = 4
    batch, _ = pipe.next_batch(5, SectionTimer())  # sends version 4 first: nothing is stale
    assert batch[VERSION].tolist() == [4] * (2 * N) and actor.sent == [4]
    plain = RolloutSource({"actor": FakeActor(), "rollout": FakeRollout(FakeActor())}, n=N)
    plain.load_state_dict(pipe.state_dict())
    assert plain.policy_version == 4
