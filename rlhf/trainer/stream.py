"""The bookkeeping of streaming rollouts (trainer.async_mode streaming), with no Ray or torch.

vLLM's in-process `LLM(...)` has no engine loop running behind the driver's back, so the stream
generates in segments: each round, every sample in flight gets at most rollout.segment_tokens
new tokens, resubmitted as its prompt + the tokens it has so far (token in, token out). Between
rounds the driver hands finished groups to the trainer and pushes new weights, so a sample in
flight continues under the new version: a partial rollout. `RolloutStream` is the state of it:

- prompts: drawn in stream order (their index is their position in the prompt stream, from 0),
  queued until `slots` has room for a group's n samples, which then start together;
- each sample's tokens, with the policy version and sampler log-prob of every token;
- finished groups in a FIFO buffer, handed over whole (GRPO's advantages need the group);
- the staleness bound: a token sampled by version v is trained at version V >= v, and
  V - v <= max_staleness. A sample holding a token beyond it is regenerated from scratch
  (stale_policy regenerate) or its group dropped (drop); both counted. Versions only advance
  when the trainer takes a batch, so the bound is enforced each time the version changes
  (`expire`) and again when a batch is taken.
- each drawn prompt's fate: queued, generating, buffered, trained or dropped;
- with an environment (rollout.env, `env=True`) each sample is a multi-turn episode: a model
  turn ends at a stop, at max_new_tokens or at the episode's max_response_tokens; the sample
  then waits (`turns_ended`) until the driver brings the environment's answer (`observe`),
  whose observation tokens are appended as context (model_mask False) before the next turn.
  A turn a weight update interrupts continues from its tokens like any other sample.

The checkpoint's part (`state_dict`) is all of it: queue, groups in flight with their tokens,
buffer, ledger, counters. A run resumed from it continues every sample in flight from its
tokens so far and trains the buffered groups, so each drawn prompt is trained (or dropped)
exactly once; the driver saves only between steps, after the groups a step took are trained.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

QUEUED: str = "queued"  # a drawn prompt's fates
GENERATING: str = "generating"
BUFFERED: str = "buffered"
TRAINED: str = "trained"
DROPPED: str = "dropped"
STOP_REASONS = ("stop",)  # a finish reason that ends a response before its token limit


@dataclass
class Sample:
    """One response being generated: its tokens so far, each token's version and log-prob."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    model_mask: list[bool] = field(default_factory=list)  # False on environment tokens
    done: bool = False
    finish_reason: str = ""
    segments: int = 0  # segments sampled since it (re)started: the seed's segment counter
    restarts: int = 0  # times regenerated (staleness, or an environment lost): its seeds
    turns: int = 0  # model turns ended (multi-turn)
    turn_start: int = 0  # where the current model turn starts in `tokens`
    awaiting: bool = False  # its turn ended; the environment answers next (multi-turn)
    reward: float = 0.0  # the environment's rewards, summed (multi-turn)
    env_metrics: dict[str, float] = field(default_factory=dict)  # its metrics, summed

    def reset(self) -> None:
        self.tokens, self.log_probs, self.versions, self.model_mask = [], [], [], []
        self.done, self.finish_reason, self.segments = False, "", 0
        self.turns, self.turn_start, self.awaiting, self.reward = 0, 0, False, 0.0
        self.env_metrics = {}
        self.restarts += 1


@dataclass
class Group:
    """The n samples of one prompt (`index`: its position in the prompt stream)."""

    index: int
    prompt: Any  # the driver's row: opaque here, resubmitted with each segment
    prompt_ids: list[int]
    samples: list[Sample]

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    def oldest_version(self) -> int | None:
        versions = [min(s.versions) for s in self.samples if s.versions]
        return min(versions) if versions else None


@dataclass(frozen=True)
class Request:
    """One segment to sample: (group, sample) `key`, its token ids in (prompt + tokens so far;
    the first `prompt_len` are what an unsegmented generation of the current model turn has as
    its prompt: the prompt, and with an environment the earlier turns and observations), at
    most `max_tokens` new ones, and its seed's
    parts (`seed_parts`: prompt index, sample, restarts, segment), so a resumed run samples the
    same segment with the same seed."""

    key: tuple[int, int]
    input_ids: list[int]
    prompt_len: int
    max_tokens: int
    seed_parts: tuple[int, int, int, int]


@dataclass(frozen=True)
class Segment:
    """What the sampler returned for one Request: new tokens, their log-probs, finish reason."""

    tokens: list[int]
    log_probs: list[float]
    finish_reason: str


class RolloutStream:
    """Streaming rollout state (see the module docstring): slots, buffer, staleness, fates."""

    def __init__(self, *, n: int, slots: int, max_staleness: int, max_new_tokens: int,
                 segment_tokens: int, stale_policy: Literal["drop", "regenerate"],
                 env: bool = False, max_turns: int = 1, max_response_tokens: int | None = None):
        if slots < n:
            raise ValueError(f"{slots} sample slots cannot hold a group of {n} samples; raise "
                             "rollout.stream_slots to at least rollout.n")
        if stale_policy not in ("drop", "regenerate"):
            raise ValueError(f"stale_policy must be drop or regenerate, got {stale_policy!r}")
        self.n, self.slots, self.max_staleness = n, slots, max_staleness
        self.max_new_tokens, self.segment_tokens = max_new_tokens, segment_tokens
        self.stale_policy = stale_policy
        self.env, self.max_turns = env, max_turns  # max_new_tokens is then per model turn
        self.max_response_tokens = max_response_tokens or max_new_tokens
        self.queue: deque[tuple[int, Any, list[int]]] = deque()  # drawn, not started
        self.drawn = 0  # prompts drawn from the stream so far (the next one's index)
        self.generating: dict[int, Group] = {}
        self.buffer: deque[Group] = deque()
        self.fates: dict[int, str] = {}
        self.counts = {"interrupted": 0, "dropped_samples": 0, "dropped_groups": 0,
                       "regenerated_samples": 0, "segments": 0, "tokens": 0,
                       "env_truncated": 0, "env_restarts": 0}

    # ---- the prompt stream and the slots ------------------------------------------------------

    def queue_prompts(self, prompts: Iterable[tuple[Any, list[int]]]) -> None:
        """Append drawn prompts ((row, prompt token ids), in stream order) to the queue."""
        for row, ids in prompts:
            self.queue.append((self.drawn, row, list(ids)))
            self.fates[self.drawn] = QUEUED
            self.drawn += 1

    def busy_slots(self) -> int:
        return sum(1 for g in self.generating.values() for s in g.samples if not s.done)

    def start(self) -> int:
        """Start queued prompts while the slots have room for a group; returns how many."""
        started = 0
        while self.queue and self.slots - self.busy_slots() >= self.n:
            index, row, ids = self.queue.popleft()
            self.generating[index] = Group(index, row, ids, [Sample() for _ in range(self.n)])
            self.fates[index] = GENERATING
            started += 1
        return started

    # ---- one segment round --------------------------------------------------------------------

    def requests(self, *, version: int) -> list[Request]:
        """A segment for every unfinished sample, to be sampled by `version`; a sample whose
        last token another version sampled continues across that weight update (counted)."""
        out = []
        for index in sorted(self.generating):
            group = self.generating[index]
            for j, s in enumerate(group.samples):
                if s.done or s.awaiting:
                    continue
                if s.versions and s.versions[-1] != version:
                    self.counts["interrupted"] += 1
                room = min(self.max_new_tokens - (len(s.tokens) - s.turn_start),
                           self.max_response_tokens - len(s.tokens))
                out.append(Request((index, j), group.prompt_ids + s.tokens,
                                   len(group.prompt_ids) + s.turn_start,
                                   min(self.segment_tokens, room),
                                   (index, j, s.restarts, s.segments)))
        return out

    def record(self, requests: list[Request], segments: list[Segment], *, version: int) -> int:
        """Append each segment's tokens, sampled by `version`, to its sample; a group whose
        samples are all done moves to the buffer. Returns the groups finished. With an
        environment, a sample whose model turn ended waits for `observe` instead."""
        if len(requests) != len(segments):
            raise ValueError(f"{len(segments)} segments for {len(requests)} requests")
        for request, seg in zip(requests, segments):
            index, j = request.key
            if index not in self.generating:
                raise KeyError(f"a segment for prompt {index}, which is not generating")
            if len(seg.tokens) != len(seg.log_probs) or len(seg.tokens) > request.max_tokens:
                raise ValueError(f"prompt {index} sample {j}: {len(seg.tokens)} tokens, "
                                 f"{len(seg.log_probs)} log-probs for at most "
                                 f"{request.max_tokens} tokens")
            s = self.generating[index].samples[j]
            s.tokens += seg.tokens
            s.log_probs += seg.log_probs
            s.versions += [version] * len(seg.tokens)
            s.model_mask += [True] * len(seg.tokens)
            s.segments += 1
            s.finish_reason = seg.finish_reason
            # The turn ends when the sampler stopped it (EOS, stop string) or at a token
            # limit; "length" before the limits is only the segment's end.
            ended = (seg.finish_reason in STOP_REASONS
                     or len(s.tokens) - s.turn_start >= self.max_new_tokens
                     or len(s.tokens) >= self.max_response_tokens)
            if ended and self.env:
                s.awaiting, s.turns = True, s.turns + 1
            else:
                s.done = ended
            self.counts["segments"] += 1
            self.counts["tokens"] += len(seg.tokens)
        return self._finish({r.key[0] for r in requests})

    def _finish(self, indices) -> int:
        """Groups among `indices` whose samples are all done move to the buffer; how many."""
        finished = 0
        for index in sorted(indices):
            group = self.generating[index]
            if group.done:
                del self.generating[index]
                self.buffer.append(group)
                self.fates[index] = BUFFERED
                finished += 1
        return finished

    # ---- multi-turn: the environment's answers between model turns ----------------------------

    def turns_ended(self) -> list[tuple[tuple[int, int], Group, Sample]]:
        """((prompt, sample) key, its group, the sample) of every sample whose model turn
        ended and whose environment has not answered yet; the turn is
        sample.tokens[sample.turn_start:]."""
        return [((index, j), self.generating[index], s) for index in sorted(self.generating)
                for j, s in enumerate(self.generating[index].samples) if s.awaiting]

    def observe(self, key: tuple[int, int], *, ids: list[int] | None, reward: float,
                done: bool, metrics: dict[str, float] | None = None) -> None:
        """The environment's answer to a sample's ended turn: its reward and metrics (summed
        over the episode), whether it ended the episode, the observation's token ids (None:
        none) appended as context before the next model turn. The episode also ends after
        rollout.max_turns turns, or when the observation leaves no room for a model token
        (counted as env_truncated)."""
        s = self.generating[key[0]].samples[key[1]]
        if not s.awaiting:
            raise ValueError(f"prompt {key[0]} sample {key[1]} has no ended turn to answer")
        s.awaiting, s.reward = False, s.reward + reward
        for name, value in (metrics or {}).items():
            s.env_metrics[name] = s.env_metrics.get(name, 0.0) + value
        ids = ids or []
        if done or s.turns >= self.max_turns:
            s.done = True
        elif len(s.tokens) + len(ids) >= self.max_response_tokens:
            s.done = True
            self.counts["env_truncated"] += 1
        else:  # context tokens: no log-prob, the version of the turn they answer
            s.tokens += ids
            s.log_probs += [0.0] * len(ids)
            s.versions += [s.versions[-1] if s.versions else 0] * len(ids)
            s.model_mask += [False] * len(ids)
            s.turn_start = len(s.tokens)
        self._finish([key[0]])

    def fail(self, key: tuple[int, int], *, reward: float) -> None:
        """End a sample's episode whose environment failed, with `reward` as its score
        (rollout.env.on_error fallback)."""
        s = self.generating[key[0]].samples[key[1]]
        s.awaiting, s.done, s.reward = False, True, reward
        self._finish([key[0]])

    def restart_episodes(self) -> int:
        """Regenerate every unfinished sample past its first model turn: its environment's
        state was lost (a resumed run's environments start empty). Returns how many."""
        restarted = 0
        for index in sorted(self.generating):
            for s in self.generating[index].samples:
                if not s.done and s.turns > 0:
                    s.reset()
                    restarted += 1
        self.counts["env_restarts"] += restarted
        return restarted

    # ---- staleness and the hand-over ----------------------------------------------------------

    def expire(self, *, version: int) -> None:
        """Enforce the bound at policy version `version` (call it when the version changes):
        a token older than version - max_staleness is never trainable again. Stale samples in
        flight or buffered are regenerated from scratch (their group back in flight) or their
        group dropped, per stale_policy."""
        oldest_ok = version - self.max_staleness
        for group in list(self.buffer) + [self.generating[i] for i in sorted(self.generating)]:
            oldest = group.oldest_version()
            if oldest is None or oldest >= oldest_ok:
                continue
            if self.stale_policy == "drop":
                self._drop(group)
                continue
            for s in group.samples:
                if s.versions and min(s.versions) < oldest_ok:
                    s.reset()
                    self.counts["regenerated_samples"] += 1
            if group in self.buffer:
                self.buffer.remove(group)
                self.generating[group.index] = group
                self.fates[group.index] = GENERATING

    def _drop(self, group: Group) -> None:
        if group in self.buffer:
            self.buffer.remove(group)
        else:
            del self.generating[group.index]
        self.fates[group.index] = DROPPED
        self.counts["dropped_groups"] += 1
        self.counts["dropped_samples"] += len(group.samples)

    def ready(self) -> int:
        """Finished groups waiting in the buffer."""
        return len(self.buffer)

    def take(self, groups: int, *, version: int) -> list[Group]:
        """The `groups` oldest finished groups, to be trained at policy version `version`
        (marked trained: the driver checkpoints only after their step); [] while the buffer
        holds fewer. Every token of them is within the staleness bound (checked)."""
        self.expire(version=version)
        if len(self.buffer) < groups:
            return []
        out = [self.buffer.popleft() for _ in range(groups)]
        for group in out:
            oldest = group.oldest_version()
            assert oldest is None or version - oldest <= self.max_staleness  # expire's rule
            self.fates[group.index] = TRAINED
        return out

    # ---- metrics and checkpoints --------------------------------------------------------------

    def fate_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {fate: 0 for fate in (QUEUED, GENERATING, BUFFERED, TRAINED,
                                                        DROPPED)}
        for fate in self.fates.values():
            counts[fate] += 1
        return counts

    def state_dict(self) -> dict:
        """Everything a resumed run needs to train each drawn prompt exactly once (copies)."""
        return copy.deepcopy({
            "drawn": self.drawn, "queue": list(self.queue),
            "generating": [self.generating[i] for i in sorted(self.generating)],
            "buffer": list(self.buffer), "fates": self.fates, "counts": self.counts,
            "settings": {"n": self.n, "max_new_tokens": self.max_new_tokens}})

    def load_state_dict(self, state: dict) -> None:
        settings = {"n": self.n, "max_new_tokens": self.max_new_tokens}
        if state["settings"] != settings:
            raise ValueError(f"the checkpoint's stream was sampled with {state['settings']}, "
                             f"this run has {settings}; resume with the same rollout.n and "
                             "rollout.max_new_tokens")
        state = copy.deepcopy(state)
        self.drawn, self.queue = state["drawn"], deque(state["queue"])
        self.generating = {g.index: g for g in state["generating"]}
        self.buffer = deque(state["buffer"])
        self.fates, self.counts = state["fates"], {**self.counts, **state["counts"]}
        for group in [*self.generating.values(), *self.buffer]:
            for s in group.samples:  # checkpoints before multi-turn streaming had no mask
                if "model_mask" not in vars(s):
                    s.model_mask, s.env_metrics = [True] * len(s.tokens), {}
