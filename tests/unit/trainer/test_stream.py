"""RolloutStream (streaming rollouts' bookkeeping) driven by a fake sampler with long-tailed
response lengths: whole groups handed over, partial rollouts continued across weight updates,
per-token versions within the staleness bound, drop and regenerate counted, and the accounting
of every drawn prompt across a kill and resume at random points."""

import pickle
import random
import zlib
from typing import Literal

import pytest

from rlhf.trainer.stream import (
    BUFFERED,
    DROPPED,
    GENERATING,
    QUEUED,
    TRAINED,
    RolloutStream,
    Segment,
)

N, MAX_NEW, SEGMENT = 3, 40, 8
Policy = Literal["drop", "regenerate"]


def _hash(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def target_length(index: int, j: int, restarts: int) -> int:
    """Long-tailed: most responses are short, one in eight runs to the limit."""
    h = _hash(index, j, restarts)
    return MAX_NEW + 5 if h % 8 == 0 else 2 + h % 10


def fake_sample(request, *, version: int) -> Segment:
    """Deterministic in (seed parts, tokens so far, version): a resumed run samples alike."""
    index, j, restarts, segment = request.seed_parts
    so_far = len(request.input_ids) - 2  # every prompt has 2 tokens
    left = target_length(index, j, restarts) - so_far
    k = min(request.max_tokens, max(left, 0))
    tokens = [_hash(request.seed_parts, i, version) % 1000 for i in range(k)]
    return Segment(tokens, [-(version + 1.0)] * k, "stop" if k == left else "length")


class Run:
    """A driver over the stream: a prompt loader (its position checkpointed), segment rounds,
    a trainer that takes `batch` groups per step, checkpoints every `save_every` steps."""

    def __init__(self, *, policy: Literal["drop", "regenerate"] = "regenerate", max_staleness=1,
                 slots=9, batch=2, save_every=2):
        self.stream = RolloutStream(n=N, slots=slots, max_staleness=max_staleness,
                                    max_new_tokens=MAX_NEW, segment_tokens=SEGMENT,
                                    stale_policy=policy)
        self.batch, self.save_every = batch, save_every
        self.loader_position, self.version, self.step = 0, 0, 0
        self.trained: list[tuple[int, int, list]] = []  # (step, prompt, per-token versions)
        self.checkpoint = None

    def refill(self):
        if len(self.stream.queue) < 2:  # a loader batch of 4 prompts
            rows = [(p, [p % 7, 1]) for p in range(self.loader_position, self.loader_position + 4)]
            self.loader_position += 4
            self.stream.queue_prompts(rows)

    def round(self):
        """One segment round; a training step when enough groups finished."""
        self.refill()
        self.stream.start()
        requests = self.stream.requests(version=self.version)
        segments = [fake_sample(r, version=self.version) for r in requests]
        self.stream.record(requests, segments, version=self.version)
        groups = self.stream.take(self.batch, version=self.version)
        if groups:
            self.step += 1
            for g in groups:
                assert [s.done for s in g.samples] == [True] * N  # whole groups only
                versions = [v for s in g.samples for v in s.versions]
                self.trained.append((self.step, g.index, versions))
            self.version += 1  # the update
            self.stream.expire(version=self.version)
            if self.step % self.save_every == 0:
                self.save()

    def save(self):
        self.checkpoint = pickle.dumps({  # as a checkpoint file would hold it
            "stream": self.stream.state_dict(), "loader": self.loader_position,
            "version": self.version, "step": self.step, "trained": list(self.trained)})

    def resume_from(self, blob):
        """A fresh process: a new stream and loader restored from the checkpoint; what the
        killed run trained after that checkpoint is lost with its weights."""
        state = pickle.loads(blob)
        self.stream.load_state_dict(state["stream"])
        self.loader_position, self.version = state["loader"], state["version"]
        self.step, self.trained = state["step"], state["trained"]

    def run_to(self, steps, *, rounds_limit=2000):
        for _ in range(rounds_limit):
            if self.step >= steps:
                return
            self.round()
        raise AssertionError(f"no progress: step {self.step} after {rounds_limit} rounds")


def check_accounting(run: Run, *, policy: str):
    """Every drawn prompt has one fate; trained ones were trained once, within the bound."""
    stream = run.stream
    assert stream.drawn == run.loader_position  # the stream's prompts are the loader's, in order
    assert sorted(stream.fates) == list(range(stream.drawn))
    trained = [index for _, index, _ in run.trained]
    assert len(trained) == len(set(trained))
    assert set(trained) == {i for i, f in stream.fates.items() if f == TRAINED}
    dropped = {i for i, f in stream.fates.items() if f == DROPPED}
    assert not set(trained) & dropped
    if policy == "regenerate":
        assert not dropped and stream.counts["dropped_samples"] == 0
    assert stream.counts["dropped_samples"] == N * len(dropped)
    live = {i for i, f in stream.fates.items() if f in (QUEUED, GENERATING, BUFFERED)}
    assert live == ({i for i, _, _ in stream.queue} | set(stream.generating)
                    | {g.index for g in stream.buffer})
    for step, _, versions in run.trained:
        assert versions and all(step - 1 - v <= stream.max_staleness for v in versions)


@pytest.mark.parametrize("policy", ["regenerate", "drop"])
def test_groups_are_handed_over_whole_within_the_staleness_bound(policy: Policy):
    run = Run(policy=policy)
    run.run_to(12)
    check_accounting(run, policy=policy)
    counts = run.stream.counts
    # long responses cross weight updates: some trained samples hold tokens of two versions
    assert counts["interrupted"] > 0
    assert any(len(set(versions)) > 1 for _, _, versions in run.trained)
    if policy == "drop":
        assert counts["dropped_groups"] > 0 and counts["regenerated_samples"] == 0
    else:
        assert counts["regenerated_samples"] > 0
    # FIFO: groups go in the order they finished; every trained token has its log-prob
    assert [i for s, i, _ in run.trained if s == 1] == [i for s, i, _ in run.trained[:2]]


def test_a_larger_bound_drops_nothing_that_fits_it():
    run = Run(policy="drop", max_staleness=8)  # a response needs at most 5 segments
    run.run_to(10)
    check_accounting(run, policy="drop")
    assert run.stream.counts["dropped_samples"] == 0
    assert max(step - 1 - min(v) for step, _, v in run.trained) >= 2  # bound 1 would drop


def test_a_continued_sample_is_resubmitted_with_its_tokens_so_far():
    stream = RolloutStream(n=1, slots=1, max_staleness=2, max_new_tokens=10, segment_tokens=4,
                           stale_policy="regenerate")
    stream.queue_prompts([("row", [5, 6])])
    assert stream.start() == 1
    (r,) = stream.requests(version=0)
    assert r.input_ids == [5, 6] and r.max_tokens == 4 and r.seed_parts == (0, 0, 0, 0)
    stream.record([r], [Segment([1, 2, 3, 4], [-.1, -.2, -.3, -.4], "length")], version=0)
    (r,) = stream.requests(version=1)  # a weight update between the segments
    assert r.input_ids == [5, 6, 1, 2, 3, 4] and r.seed_parts == (0, 0, 0, 1)
    assert stream.counts["interrupted"] == 1
    stream.record([r], [Segment([7, 8, 9, 10], [-1.0] * 4, "length")], version=1)
    (r,) = stream.requests(version=1)
    assert r.max_tokens == 2  # the response limit, not the segment's
    stream.record([r], [Segment([11, 12], [-2.0] * 2, "length")], version=1)
    assert stream.requests(version=1) == [] and stream.ready() == 1  # done at the limit
    (g,) = stream.take(1, version=2)
    assert g.samples[0].versions == [0] * 4 + [1] * 6
    assert g.samples[0].log_probs[:2] == [-.1, -.2]
    assert stream.fates == {0: TRAINED}


def test_stale_buffered_groups_are_regenerated_or_dropped():
    policies: tuple[Policy, ...] = ("regenerate", "drop")
    for policy in policies:
        stream = RolloutStream(n=1, slots=2, max_staleness=1, max_new_tokens=4,
                               segment_tokens=4, stale_policy=policy)
        stream.queue_prompts([("a", [1]), ("b", [2])])
        stream.start()
        reqs = stream.requests(version=0)
        stream.record(reqs, [Segment([3], [-1.0], "stop"), Segment([4], [-1.0], "stop")],
                      version=0)
        assert len(stream.take(1, version=1)) == 1  # staleness 1: within the bound
        assert stream.take(1, version=2) == []  # prompt 1's tokens are 2 versions old
        if policy == "drop":
            assert stream.fates[1] == DROPPED and stream.counts["dropped_samples"] == 1
        else:
            assert stream.fates[1] == GENERATING and stream.counts["regenerated_samples"] == 1
            (r,) = stream.requests(version=2)
            assert r.input_ids == [2] and r.seed_parts == (1, 0, 1, 0)  # a fresh seed


@pytest.mark.parametrize("policy", ["regenerate", "drop"])
def test_kill_and_resume_at_random_points_trains_every_prompt_once(policy: Policy):
    """Kill after a random number of rounds, resume from the last checkpoint in a fresh
    stream, several times over: the accounting holds and the run trains exactly what an
    uninterrupted one trains (same prompts, same steps, same token versions)."""
    steps = 20
    whole = Run(policy=policy)
    whole.run_to(steps)
    check_accounting(whole, policy=policy)
    rng = random.Random(policy)
    for _ in range(6):
        run, kills = Run(policy=policy), 0
        while run.step < steps:
            for _ in range(rng.randrange(1, 8)):  # the kill: between any two rounds
                if run.step >= steps:
                    break
                run.round()
            if run.step >= steps:
                break
            blob = run.checkpoint
            run = Run(policy=policy)
            if blob is not None:
                run.resume_from(blob)
                run.checkpoint = blob
            kills += 1
        assert 2 < kills < 200
        check_accounting(run, policy=policy)
        assert run.trained == whole.trained
        assert run.stream.fates == whole.stream.fates


def test_bad_settings_and_resumes_name_the_fix():
    with pytest.raises(ValueError, match="stream_slots"):
        RolloutStream(n=4, slots=3, max_staleness=1, max_new_tokens=8, segment_tokens=4,
                      stale_policy="drop")
    stream = RolloutStream(n=2, slots=4, max_staleness=1, max_new_tokens=8, segment_tokens=4,
                           stale_policy="drop")
    other = RolloutStream(n=4, slots=4, max_staleness=1, max_new_tokens=8, segment_tokens=4,
                          stale_policy="drop")
    with pytest.raises(ValueError, match="rollout.n"):
        other.load_state_dict(stream.state_dict())
    stream.queue_prompts([("a", [1])])
    stream.start()
    reqs = stream.requests(version=0)
    with pytest.raises(ValueError, match="at most 4 tokens"):
        stream.record(reqs[:1], [Segment([1] * 5, [0.0] * 5, "length")], version=0)
