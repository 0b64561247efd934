"""StreamingPipeline (trainer.async_mode streaming) against scripted fakes of the actor and the
rollout pool: segments resubmitted with their tokens so far, weights pushed between segments
(samples in flight continue under the new version), whole groups per step, per-token versions
and sampler log-probs as the ratio's denominator, the staleness bound, and resume."""

import pickle
import re
from types import SimpleNamespace
from typing import Literal

import pytest
import torch

from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.errors import ConfigError
from rlhf.trainer.metrics import SectionTimer
from rlhf.trainer.rollout_source import (
    TOKEN_VERSIONS,
    RolloutSource,
    StreamingPipeline,
    streaming_pipeline,
)
from rlhf.trainer.stream import RolloutStream
from tests.unit.trainer.test_async_loop import Done, FakeActor, FakeRollout

N, GROUPS, MAX_NEW, SEGMENT = 2, 2, 12, 4


class Call(Done):
    """A PendingCall that has finished (the driver waits with a timeout)."""

    def get(self, timeout_s=None):
        assert timeout_s is not None  # every wait of the stream is bounded
        return self.value


def length_of(prompt_id: int) -> int:
    return MAX_NEW if prompt_id % 3 == 0 else 1 + (prompt_id * 5) % 6


class SegmentRollout(FakeRollout):
    """Token t of a response is 100 * engine version + t; log-prob -(version + 1); the
    response of prompt p (its first token) stops after length_of(p) tokens."""

    def __init__(self, actor):
        super().__init__(actor)
        self.segments = []  # (inputs, max_tokens, engine version) per call

    def generate_segments(self, batch, blocking=True):
        rows = batch["input_ids"].to_list()
        limits = batch["max_tokens"].tolist()
        self.segments.append(([r.tolist() for r in rows], limits, self.engine_version))
        ids, lps, stopped = [], [], []
        for row, limit in zip(rows, limits):
            so_far = len(row) - 2
            left = length_of(int(row[0])) - so_far
            k = min(limit, left)
            ids.append([100 * self.engine_version + so_far + t for t in range(k)])
            lps.append([-(self.engine_version + 1.0)] * k)
            stopped.append(k == left)
        return segment_result(ids, lps, stopped, blocking)


def segment_result(ids, lps, stopped, blocking):
    """What `generate_segments` returns for these rows' new tokens, log-probs and stops (a
    `Call` to wait on when not `blocking`)."""
    out = Batch(meta={"metrics": {"rollout/seconds": 0.01}}, fields={
        "response_ids": Ragged.from_list(ids, dtype=torch.int64),
        "rollout_log_probs": Ragged.from_list(lps, dtype=torch.float32),
        "stopped": torch.tensor(stopped)})
    return out if blocking else Call(out)


class Loader:
    def __init__(self):
        self.position = 0

    def __call__(self):
        p = self.position
        self.position += GROUPS
        return Batch({"prompt_ids": Ragged.from_list([[p + i, 7] for i in range(GROUPS)],
                                                     dtype=torch.int64),
                      "raw_prompt": [f"p{p + i}" for i in range(GROUPS)]})


def make(*, max_staleness=1, policy: Literal["drop", "regenerate"] = "regenerate", state=None):
    actor = FakeActor()
    rollout = SegmentRollout(actor)
    views: dict = {"actor": actor, "rollout": rollout}  # fakes of the two roles' views
    source = RolloutSource(views, n=N)
    stream = RolloutStream(n=N, slots=N * GROUPS, max_staleness=max_staleness,
                           max_new_tokens=MAX_NEW, segment_tokens=SEGMENT, stale_policy=policy)
    loader = Loader()
    pipe = StreamingPipeline(source, loader, stream=stream, groups_per_step=GROUPS, seed=3,
                             old_from_rollout=True, wait_timeout_s=5.0)
    restore(state, pipe, loader, actor)
    return actor, rollout, source, pipe, loader


def restore(state, pipe, loader, actor):
    """A resumed driver: the pipeline, the loader's position and the policy version from
    `state` (None: a fresh start, nothing to restore)."""
    if state is not None:
        pipe.load_state_dict(state["pipe"])
        loader.position = state["loader"]
        actor.version = state["pipe"]["source"]["policy_version"]


def train(actor, source, pipe, steps):
    seen = []
    for step in steps:
        batch, metrics = pipe.next_batch(step, SectionTimer())
        seen.append((step, batch, metrics, source.policy_version))
        actor.version += 1
        source.policy_changed()
    return seen


def test_streaming_hands_over_whole_groups_and_continues_samples_across_updates():
    actor, rollout, source, pipe, _ = make(max_staleness=2)
    seen = train(actor, source, pipe, range(1, 7))
    interrupted = 0
    for _, batch, metrics, version in seen:
        assert len(batch) == N * GROUPS
        prompts = batch["prompt_ids"].values.view(-1, 2)[:, 0].tolist()
        assert prompts[::N] == prompts[1::N]  # each prompt's n samples together: whole groups
        versions = batch[TOKEN_VERSIONS]
        for i, (ids, vs) in enumerate(zip(batch["response_ids"].to_list(), versions.to_list())):
            assert len(ids) == length_of(prompts[i])
            # each token's version is the engine's that sampled it, and its log-prob that one's
            assert (ids // 100).tolist() == vs.tolist()
            assert (version - vs).max() <= 2
        old = batch["old_log_probs"].values
        assert torch.equal(old, -(versions.values.float() + 1))  # per-token denominators
        interrupted += metrics["async/interrupted_samples"]
        assert metrics["async/token_staleness_p100"] <= 2
        assert metrics["async/dropped_samples"] == 0
    assert interrupted > 0
    assert any(len(set(vs.tolist())) > 1 for _, b, _, _ in seen
               for vs in b[TOKEN_VERSIONS].to_list())
    # a continued request carries its prompt and tokens so far; segments end at SEGMENT tokens
    continued = [(ids, limit) for inputs, limits, _ in rollout.segments
                 for ids, limit in zip(inputs, limits) if len(ids) > 2]
    assert continued and all(limit <= SEGMENT for _, limit in continued)
    assert actor.sent == [1, 2, 3, 4, 5]  # the pool got every new version before sampling on


def test_a_resumed_stream_trains_what_an_uninterrupted_one_does():
    actor, _, source, pipe, loader = make()
    whole = train(actor, source, pipe, range(1, 7))
    actor, _, source, pipe, loader = make()
    train(actor, source, pipe, range(1, 4))
    state = pickle.loads(pickle.dumps({"pipe": pipe.state_dict(), "loader": loader.position}))
    actor, rollout, source, pipe, _ = make(state=state)
    again = train(actor, source, pipe, range(4, 7))
    assert rollout.segments[0][2] == 3  # the fresh pool got the checkpoint's weights first
    for (s1, b1, _, v1), (s2, b2, _, v2) in zip(whole[3:], again):
        assert (s1, v1) == (s2, v2)
        assert b1.equal(b2)
    fates = pipe.stream.fates
    trained = [p for _, b, _, _ in whole for p in b["raw_prompt"][::N]]
    assert len(trained) == len(set(trained))
    assert sum(f == "trained" for f in fates.values()) == len(trained)


def test_a_pool_that_never_catches_up_stops_with_the_stream_state(capsys):
    """A pool stuck on stale weights regenerates forever: the wait reports the stream's state
    as it goes (the watchdog), then times out naming what it waited for and that state,
    instead of spinning silently."""
    actor, _, source, pipe, _ = make()
    pipe.wait_timeout_s = 0.5
    train(actor, source, pipe, range(1, 3))
    assert "has waited" not in capsys.readouterr().out
    pipe.report_every_s = 0.2
    source.held_version = lambda: source.policy_version  # a sync that never happens
    with pytest.raises(TimeoutError, match=r"finished groups in the buffer.*groups buffered"):
        train(actor, source, pipe, range(3, 12))
    report = capsys.readouterr().out
    assert re.search(r"step \d has waited 0\.[2-9] s for 2 finished groups; stream state: "
                     r"0 groups buffered", report), report


def test_streaming_refuses_what_it_does_not_carry_across_segments():
    """vLLM's routed experts span one generate call, not segments."""
    actor = FakeActor()
    views: dict = {"actor": actor, "rollout": SegmentRollout(actor)}
    source = RolloutSource(views, n=N)
    cfg = SimpleNamespace(rollout=SimpleNamespace(env=SimpleNamespace(path=None),
                                                  routing_replay="rollout"))
    with pytest.raises(ConfigError, match="routing_replay=trainer"):
        streaming_pipeline(cfg, source, Loader())


def test_streaming_with_colocated_rollouts_is_refused_before_any_process_starts(tmp_path):
    """A colocated engine shares the actor's ranks, which train between segments: streaming
    needs a pool that samples while the actor trains, so the config check names the fix."""
    from pathlib import Path

    from rlhf.config import load_config
    from rlhf.config.checks import check_config

    quickstart = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
    base = [f"model.path={tmp_path / 'model'}", "trainer.async_mode=streaming"]
    with pytest.raises(ConfigError, match="needs rollout ranks of their own: set "
                                          "rollout.placement=separate"):
        check_config(load_config(quickstart, base))
    check_config(load_config(quickstart, base + ["rollout.placement=separate",
                                                 "rollout.world_size=1"]))
