"""Streaming rollouts with a multi-turn environment (rollout.env, trainer.async_mode streaming)
against a scripted rollout pool: model turns that a weight update interrupts continue from their
tokens (the environment's observations included), the environment gets each turn's exact
tokens, observation tokens are context (model_mask False, log-prob 0), the episode's rewards are
summed, and a resumed run regenerates the samples whose environments it lost, training each
prompt once."""

import pickle

import pytest
import torch

from rlhf.data.batch import Batch
from rlhf.data.fields import MODEL_MASK
from rlhf.data.ragged import Ragged
from rlhf.envs import Env, StepResult
from rlhf.envs.runner import EnvRunner
from rlhf.errors import RLHFError
from rlhf.trainer.metrics import SectionTimer
from rlhf.trainer.rollout_source import (
    TOKEN_VERSIONS,
    RolloutSource,
    StreamEpisodes,
    StreamingPipeline,
)
from rlhf.trainer.stream import TRAINED, RolloutStream
from tests.unit.trainer.test_async_loop import FakeActor, FakeRollout
from tests.unit.trainer.test_streaming_pipeline import restore, segment_result

N, GROUPS, TURN, TURNS, SEGMENT = 2, 2, 5, 3, 4
OBS = [-7, -7]  # an observation's token ids (render's stand-in)


class CountEnv(Env):
    """Answers every turn with an observation; its reward is the turn's token count, and 100
    when the turn's text is its token ids written out (what `decode` below gives); fails when
    the row says so."""

    def reset(self, *, prompt, ground_truth, extra):
        self.fail = ground_truth == "fail"

    def step(self, *, text, token_ids):
        if self.fail:
            raise ValueError("scripted failure")
        exact = text == " ".join(map(str, token_ids))
        return StepResult(observation="next", reward=len(token_ids) + 100.0 * exact,
                          metrics={"steps": 1.0})


SPEC = f"{__name__}:CountEnv"


class TurnRollout(FakeRollout):
    """A model turn is TURN tokens (then it stops); token 100 * engine version + its position in
    the turn; log-prob -(version + 1). Turns start after the prompt or an observation."""

    def __init__(self, actor):
        super().__init__(actor)
        self.segments = []

    def generate_segments(self, batch, blocking=True):
        ids, lps, stopped = [], [], []
        for row, start, limit in zip(batch["input_ids"].to_list(), batch["prompt_len"].tolist(),
                                     batch["max_tokens"].tolist()):
            self.segments.append((row.tolist()[2:], self.engine_version))  # 2-token prompts
            assert OBS[0] not in row.tolist()[start:]  # the turn's prompt: earlier turns too
            in_turn = len(row) - start  # the turn's tokens so far: after the earlier turns
            k = min(limit, TURN - in_turn)
            ids.append([100 * self.engine_version + in_turn + t for t in range(k)])
            lps.append([-(self.engine_version + 1.0)] * k)
            stopped.append(in_turn + k == TURN)
        return segment_result(ids, lps, stopped, blocking)


class Loader:
    def __init__(self, truths=lambda p: "ok"):
        self.position, self.truths = 0, truths

    def __call__(self):
        p = self.position
        self.position += GROUPS
        rows = range(p, p + GROUPS)
        return Batch({"prompt_ids": Ragged.from_list([[i, 7] for i in rows], dtype=torch.int64),
                      "raw_prompt": [f"p{i}" for i in rows],
                      "ground_truth": [self.truths(i) for i in rows]})


def make(*, state=None, on_error="raise", truths=lambda p: "ok", slots=N * GROUPS):
    actor = FakeActor()
    rollout = TurnRollout(actor)
    views: dict = {"actor": actor, "rollout": rollout}  # fakes of the two roles' views
    source = RolloutSource(views, n=N)
    stream = RolloutStream(n=N, slots=slots, max_staleness=2, max_new_tokens=TURN + 1,
                           segment_tokens=SEGMENT, stale_policy="regenerate", env=True,
                           max_turns=TURNS, max_response_tokens=40)
    episodes = StreamEpisodes(EnvRunner(SPEC, num_workers=0),
                              decode=lambda ids: " ".join(map(str, ids)),
                              render=lambda obs, model_ids: list(OBS), on_error=on_error,
                              fallback_reward=-1.0)
    loader = Loader(truths)
    pipe = StreamingPipeline(source, loader, stream=stream, groups_per_step=GROUPS, seed=3,
                             old_from_rollout=True, wait_timeout_s=5.0, episodes=episodes)
    restore(state, pipe, loader, actor)
    return actor, rollout, source, pipe, loader


def train(actor, source, pipe, steps):
    seen = []
    for step in steps:
        seen.append(pipe.next_batch(step, SectionTimer()))
        actor.version += 1
        source.policy_changed()
    return seen


EPISODE = TURN + len(OBS) + TURN + len(OBS) + TURN  # three turns, two observations between
MASK = [True] * TURN + [False] * len(OBS) + [True] * TURN + [False] * len(OBS) + [True] * TURN


def test_interrupted_turns_continue_from_their_tokens_and_observations_are_context():
    actor, rollout, source, pipe, _ = make()
    seen = train(actor, source, pipe, range(1, 6))
    for batch, metrics in seen:
        assert len(batch) == N * GROUPS
        for ids, mask, lps, vs, reward in zip(
                batch["response_ids"].to_list(), batch[MODEL_MASK].to_list(),
                batch["rollout_log_probs"].to_list(), batch[TOKEN_VERSIONS].to_list(),
                batch["env_reward"].tolist()):
            assert mask.tolist() == MASK and len(ids) == EPISODE
            model = ids[mask]
            assert (ids[~mask] == OBS[0]).all() and (lps[~mask] == 0).all()
            # every model token: 100 * the version that sampled it + its place in its turn
            assert ((model // 100) == vs[mask]).all()
            assert (model % 100).tolist() == list(range(TURN)) * TURNS
            assert (lps[mask] == -(vs[mask].float() + 1)).all()
            assert reward == TURNS * (TURN + 100.0)  # each turn's exact tokens and text
        assert metrics["env/steps"] == metrics["env/turns"] == TURNS  # means per episode
        assert metrics["env/model_tokens"] == TURNS * TURN
        assert metrics["env/episode_tokens"] == EPISODE
        assert metrics["async/token_staleness_p100"] <= 2
    # a turn split by a weight update continued under the new version, after an observation
    mixed = [vs[m] for b, _ in seen for vs, m in zip(b[TOKEN_VERSIONS].to_list(),
                                                     b[MODEL_MASK].to_list())]
    assert any(len(set(v.tolist())) > 1 for v in mixed)
    assert sum(m["async/interrupted_samples"] for _, m in seen) > 0
    after_obs = [r for r, _ in rollout.segments if OBS[0] in r and r[-1] != OBS[0]]
    assert after_obs  # a second turn's later segment: prompt, turn, observation, its tokens


def test_a_resumed_run_regenerates_the_episodes_it_lost_and_trains_each_prompt_once():
    actor, _, source, pipe, loader = make(slots=2 * N * GROUPS)  # two batches in flight
    first = train(actor, source, pipe, range(1, 3))
    state = pickle.loads(pickle.dumps({"pipe": pipe.state_dict(), "loader": loader.position}))
    in_flight = [s for g in pipe.stream.generating.values() for s in g.samples
                 if not s.done and s.turns > 0]
    assert in_flight  # the checkpoint holds episodes past their first turn
    actor, _, source, pipe, loader = make(state=state, slots=2 * N * GROUPS)
    again = train(actor, source, pipe, range(3, 9))
    assert sum(m["env/restarted_samples"] for _, m in again) == len(in_flight)
    for batch, _ in again:  # regenerated episodes are whole again, with their environment
        assert batch["env_reward"].tolist() == [TURNS * (TURN + 100.0)] * len(batch)
    trained = [p for b, _ in first + again for p in b["raw_prompt"][::N]]
    assert len(trained) == len(set(trained))
    fates = pipe.stream.fates
    assert {f"p{i}" for i, f in fates.items() if f == TRAINED} == set(trained)


def test_a_failing_environment_stops_the_run_or_ends_the_episode_with_the_fallback():
    truths = lambda p: "fail" if p == 1 else "ok"  # noqa: E731
    actor, _, source, pipe, _ = make(truths=truths)
    with pytest.raises(RLHFError, match=r"(?s)prompt 1 sample 0 in step: .*scripted failure"
                                        r".*on_error: fallback"):
        train(actor, source, pipe, range(1, 3))
    actor, _, source, pipe, _ = make(truths=truths, on_error="fallback")
    (batch, metrics), = train(actor, source, pipe, range(1, 2))
    rewards = dict(zip(batch["raw_prompt"], batch["env_reward"].tolist()))
    assert rewards["p1"] == -1.0 and rewards["p0"] == TURNS * (TURN + 100.0)
    assert metrics["env/errors"] == N and metrics["env/turns"] == (TURNS + 1) / 2
