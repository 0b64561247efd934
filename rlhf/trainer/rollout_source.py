"""Where the driver samples, and sampling ahead of the trainer (trainer.async_mode).

`RolloutSource` hides the placement: colocated, the actor's own replicas sync in-process;
separate (rollout.placement), the rollout role samples and the actor sends it weights over the
transfer group (rlhf.rollout.transfer), made once when the source is built. The driver skips a
sync only when the engines hold the weights it wants: colocated, each replica decides (it
knows when the policy changed and when a sleep released its weights, rlhf.rollout.residency);
separate, the driver's record of the version it sent counts only while every rollout rank
answers that it still holds those weights (`holds_weights`).

Policy versions count the actor updates the driver has made (0 = model.path). A sample carries
the version it was sampled with (`policy_version`); its staleness is the trainer's version when
the sample is trained minus that. `RolloutPipeline` (async_mode one_step or bounded) keeps one
batch in flight: at step k it takes batch k, which the rollout pool sampled while step k-1
trained, then submits batch k+1 and returns, so batch k+1 is sampled while batch k trains.
Before each submit the rollout pool gets the current weights if the new batch would otherwise
be more than trainer.max_staleness versions old when trained (one_step: every step, so batch
k is sampled with version k-2 and trained at version k-1). Samples older than the bound are
dropped and counted (none are, while every step updates the policy once).

Resume restores the in-flight batch: a checkpoint holds it (the driver waits for it when
saving), so a resumed run trains exactly the samples an uninterrupted one would (one_step).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.controller import RoleView
from rlhf.data.batch import Batch
from rlhf.data.fields import MODEL_MASK
from rlhf.data.ragged import Ragged
from rlhf.errors import ConfigError, RLHFError
from rlhf.rollout.multiturn import env_metrics, env_rows
from rlhf.rollout.routing import records_in_rollout
from rlhf.rollout.sampling import derive_seed
from rlhf.trainer.metrics import SectionTimer
from rlhf.trainer.stream import RolloutStream, Segment

VERSION = "policy_version"  # per-sample field: the policy version that sampled it
SKIPPED_SYNC = {"sync/bytes": 0.0, "sync/full_bytes": 0.0, "sync/seconds": 0.0,
                "sync/skipped": 1.0}


def connect_weight_transfer(actor: RoleView, rollout: RoleView) -> None:
    """Make the transfer group of actor rank 0 and every rollout rank (once, at start)."""
    address = actor.open_weight_transfer(rollout.layout.world_size)
    calls = [actor.join_weight_transfer(address, blocking=False),
             rollout.join_weight_transfer(address, blocking=False)]
    for call in calls:
        call.get()


class RolloutSource:
    """The driver's sampler: sync the rollout samplers to the policy, then generate."""

    def __init__(self, views: dict[str, RoleView], *, n: int):
        self.actor, self.rollout, self.n = views["actor"], views.get("rollout"), n
        self.policy_version = 0  # actor updates so far
        self.rollout_version: int | None = 0  # what the separate engines hold; None = unknown
        if self.rollout is not None:
            connect_weight_transfer(self.actor, self.rollout)

    def policy_changed(self) -> None:
        """The driver updated the actor (one new policy version)."""
        self.policy_version += 1

    def held_version(self) -> int | None:
        """The policy version every separate rollout sampler holds: the last one sent, while
        every rank still holds it; None when unknown, colocated (the replicas decide) or when
        an engine released its weights."""
        if self.rollout is None or self.rollout_version is None:
            return None
        return self.rollout_version if all(self.rollout.holds_weights()) else None

    def sync(self) -> dict[str, float]:
        """Bring the rollout samplers to the current policy (a no-op when they hold it)."""
        if self.rollout is None:
            return {k: float(v) for k, v in self.actor.sync_weights().items()}
        if self.held_version() == self.policy_version:
            return dict(SKIPPED_SYNC)
        calls = [self.actor.send_weights(blocking=False), self.rollout.receive_weights(blocking=False)]
        sent, received = (call.get() for call in calls)
        self.rollout_version = self.policy_version
        return {**{k: float(v) for k, v in received.items()}, **sent}

    def generate(self, prompts: Batch, *, greedy: bool, blocking: bool = True):
        """Sample on whichever role hosts the engines; a PendingCall when not blocking."""
        view = self.rollout if self.rollout is not None else self.actor
        return view.generate(prompts, greedy=greedy, blocking=blocking)

    def assemble(self, prompts: Batch, out: Batch, *, greedy: bool, version: int,
                 n: int | None = None) -> tuple[Batch, dict[str, float]]:
        """Prompts repeated per sample (n of them; rollout.n when None) with the sampled fields
        and their policy version; the rollout metrics."""
        metrics = dict(out.meta.get("metrics", {}))
        fields = Batch({k: out[k] for k in out.keys()})  # the rollout's meta stays out
        n = 1 if greedy else n or self.n
        batch = prompts.repeat_interleave(n).union(fields)
        batch = batch.union(Batch({VERSION: torch.full((len(batch),), version,
                                                       dtype=torch.int64)}))
        return batch, metrics

    def state_dict(self) -> dict:
        return {"policy_version": self.policy_version}

    def load_state_dict(self, state: dict) -> None:
        """Versions of a checkpoint (an async run's in-flight batch, if any, is not used)."""
        state = state.get("source", state)
        self.policy_version = int(state["policy_version"])
        self.rollout_version = None  # fresh engines hold model.path, not this version


@dataclass
class InFlight:
    """A batch submitted to the rollout pool: its prompts, version and result (once done)."""

    prompts: Batch
    version: int
    call: Any  # PendingCall; None once `out` is known
    out: Batch | None = None

    def result(self) -> Batch:
        if self.out is None:
            self.out, self.call = self.call.get(), None
        assert self.out is not None
        return self.out


class RolloutPipeline:
    """One batch sampled ahead of the trainer (see the module docstring)."""

    def __init__(self, source: RolloutSource, draw: Callable[[int], Batch], *,
                 max_staleness: int, total_steps: int, old_from_rollout: bool):
        self.source, self.draw = source, draw
        self.max_staleness, self.total_steps = max_staleness, total_steps
        self.old_from_rollout = old_from_rollout
        self.pending: InFlight | None = None
        self._busy_since: float | None = None  # when the rollout pool's last sync+sample began
        self._busy_s = 0.0  # how long that sync+sample took on the rollout pool

    def next_batch(self, step: int, timer: SectionTimer) -> tuple[Batch, dict[str, float]]:
        """Batch `step` (waiting for it if still sampling), after submitting batch step + 1."""
        metrics: dict[str, float] = {}
        if self.pending is None:  # the first step: nothing sampled ahead yet
            metrics.update(self._submit(step, ahead=0, timer=timer))
        assert self.pending is not None  # submitted above or by the previous step
        with timer("wait_rollout"):
            current, out = self.pending, self.pending.result()
        self.pending = None
        batch, rollout_metrics = self.source.assemble(current.prompts, out, greedy=False,
                                                      version=current.version)
        self._busy_s += rollout_metrics.get("rollout/seconds", 0.0)
        if step < self.total_steps:  # overlaps this batch's training
            metrics.update(self._submit(step + 1, ahead=1, timer=timer))
        batch, admit = self.admit(batch)
        metrics.update(rollout_metrics, **admit)  # the trainer's wait: timing/wait_rollout
        return batch, metrics

    def _submit(self, step: int, *, ahead: int, timer: SectionTimer) -> dict[str, float]:
        """Sync if needed, then start sampling batch `step`, trained after `ahead` more
        updates; returns the sync metrics and the rollout pool's idle time since it finished."""
        source = self.source
        now = time.perf_counter()
        metrics = {}
        if self._busy_since is not None:
            metrics["async/rollout_idle_s"] = max(0.0, now - self._busy_since - self._busy_s)
        self._busy_since = now
        trained_at = source.policy_version + ahead
        held = source.held_version()
        behind = held is None or trained_at - held > self.max_staleness
        with timer("sync_weights"):
            sync = source.sync() if behind else dict(SKIPPED_SYNC)
        self._busy_s = sync.get("sync/seconds", 0.0)
        prompts = self.draw(step)
        version = source.rollout_version if source.rollout is not None else source.policy_version
        assert version is not None  # synced above unless the pool held a known version
        self.pending = InFlight(prompts, version, source.generate(prompts, greedy=False,
                                                                  blocking=False))
        return {**metrics, **sync}

    def admit(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Drop samples more than max_staleness versions behind the policy; the staleness
        histogram (async/staleness_<s>: fraction of samples) and async/dropped_samples. With
        async_old_log_probs rollout, the rollout log-probs become `old_log_probs`."""
        staleness = self.source.policy_version - batch[VERSION]
        keep = staleness <= self.max_staleness
        metrics = {"async/dropped_samples": float((~keep).sum()),
                   "async/staleness_mean": float(staleness.float().mean()),
                   "async/staleness_max": float(staleness.max()),
                   "async/policy_version": float(self.source.policy_version)}
        for s in range(self.max_staleness + 1):
            metrics[f"async/staleness_{s}"] = float((staleness == s).float().mean())
        if not bool(keep.all()):
            batch = batch.select(torch.nonzero(keep).flatten().tolist())
        if len(batch) == 0:
            raise RuntimeError("every sample of the batch is older than trainer.max_staleness; "
                               "raise trainer.max_staleness")
        if self.old_from_rollout:
            batch = batch.union(Batch({"old_log_probs": batch["rollout_log_probs"]}))
        return batch, metrics

    def close(self) -> None:
        """Nothing to stop (StreamingPipeline's multi-turn environments have processes)."""

    def state_dict(self) -> dict:
        """The in-flight batch (waited for) and the versions, for a checkpoint."""
        pending = None
        if self.pending is not None:
            pending = {"prompts": self.pending.prompts, "version": self.pending.version,
                       "out": self.pending.result()}
        return {"pending": pending, "source": self.source.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "source" not in state:  # a synchronous run's checkpoint: nothing was in flight
            state = {"source": state, "pending": None}
        self.source.load_state_dict(state["source"])
        pending = state["pending"]
        self.pending = (None if pending is None else
                        InFlight(pending["prompts"], pending["version"], None, pending["out"]))
        self._busy_since = None


TOKEN_VERSIONS = "token_versions"  # streaming: per response token, the version that sampled it


class StreamEpisodes:
    """The environments of a streaming run's multi-turn samples (rollout.env), on the driver:
    whichever rollout rank samples a sample's next segment, its environment stays here. At
    each ended model turn the episode's environment is reset first if the sample has none yet
    (its first turn, or it was regenerated), then stepped with the turn's text and exact
    token ids; the observation is rendered for that turn only and appended (RolloutStream
    .observe). A resumed run's environments start empty: samples past their first turn are
    regenerated (RolloutStream.restart_episodes), so each prompt is still trained once."""

    def __init__(self, runner, *, decode: Callable[[list[int]], str],
                 render: Callable[..., list[int]], on_error: str, fallback_reward: float):
        self.runner, self.decode, self.render = runner, decode, render
        self.on_error, self.fallback_reward = on_error, fallback_reward
        self.episodes: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (restarts, id)
        self.next_id = 0
        # since the last step's metrics: failed calls by kind, and "seconds" in the calls
        self.failures: dict[str, float] = defaultdict(float)

    def play(self, stream: RolloutStream) -> None:
        """Answer every ended turn of `stream`; end the environments of finished samples."""
        ended = stream.turns_ended()
        resets = {}
        for key, group, s in ended:
            known = self.episodes.get(key)
            if known is None or known[0] != s.restarts:  # first turn, or regenerated
                if known is not None:
                    self.runner.end([known[1]])
                self.episodes[key] = (s.restarts, self.next_id)
                resets[self.next_id] = env_rows(group.prompt)[0]
                self.next_id += 1
        outcomes = self._call("reset", resets, stream, ended)
        turns = {}
        for key, _, s in ended:
            episode = self.episodes[key][1]
            if outcomes.get(episode, ("ok",))[0] == "ok":
                ids = s.tokens[s.turn_start:]
                turns[episode] = {"text": self.decode(ids), "token_ids": ids}
        outcomes = self._call("step", turns, stream, ended)
        for key, _, _ in ended:
            episode = self.episodes[key][1]
            if episode not in turns or outcomes[episode][0] != "ok":
                continue  # failed: _call ended it
            result = outcomes[episode][1]
            obs = (None if result.observation is None else
                   self.render(result.observation, model_ids=turns[episode]["token_ids"]))
            stream.observe(key, ids=obs, reward=result.reward, done=result.done,
                           metrics=result.metrics)
        live = {key for key, (_, episode) in self.episodes.items()
                if key[0] in stream.generating
                and not stream.generating[key[0]].samples[key[1]].done}
        finished = [key for key in self.episodes if key not in live]
        if finished:
            self.runner.end([self.episodes.pop(key)[1] for key in finished])

    def _call(self, method: str, payloads: dict, stream: RolloutStream, ended) -> dict:
        if not payloads:
            return {}
        began = time.perf_counter()
        outcomes = getattr(self.runner, method)(payloads)
        self.failures["seconds"] += time.perf_counter() - began
        for key, _, _ in ended:
            episode = self.episodes[key][1]
            kind, cause = outcomes.get(episode, ("ok", None))
            if kind == "ok":
                continue
            if self.on_error == "raise":
                raise RLHFError(f"environment {getattr(self.runner, 'spec', '?')!r} failed on "
                                f"prompt {key[0]} sample {key[1]} in {method}: {cause}\nFix the "
                                "environment (or raise rollout.env.timeout_s), or set "
                                "rollout.env.on_error: fallback to end such episodes with "
                                "rollout.env.fallback_reward")
            self.failures["errors" if kind == "error" else "timeouts"] += 1
            stream.fail(key, reward=self.fallback_reward)
        return outcomes

    def metrics(self, samples: list, *, truncated: float) -> dict[str, float]:
        """As multi-turn rollouts report them (`rlhf.rollout.multiturn.env_metrics`), over the
        episodes a step trains; errors, timeouts and seconds in environment calls since the
        last step, and `truncated` episodes (RolloutStream's count since then)."""
        sums: dict[str, float] = {
            "episodes": float(len(samples)), "turns": float(sum(s.turns for s in samples)),
            "episode_tokens": float(sum(len(s.tokens) for s in samples)),
            "model_tokens": float(sum(sum(s.model_mask) for s in samples)),
            "truncated": truncated, **self.failures}
        for s in samples:
            for name, value in s.env_metrics.items():
                sums[f"m/{name}"] = sums.get(f"m/{name}", 0.0) + value
        self.failures = defaultdict(float)
        return env_metrics(sums)

    def close(self) -> None:
        self.runner.close()


class StreamingPipeline:
    """trainer.async_mode streaming: the rollout pool samples continuously in segments
    (rlhf.trainer.stream keeps the books). Each step takes data.train_batch_size finished
    groups, oldest first; while it trains, the pool samples the next segment. Before every
    segment the pool gets the current weights when the policy changed, so a sample in flight
    continues under the new version (a partial rollout) and its tokens carry the versions and
    sampler log-probs that produced them: with async_old_log_probs rollout, `old_log_probs`
    are those per-token sampler log-probs, so the update's ratio corrects each token towards
    the policy that sampled it."""

    def __init__(self, source: RolloutSource, draw: Callable[[], Batch], *, stream,
                 groups_per_step: int, seed: int, old_from_rollout: bool,
                 wait_timeout_s: float, episodes: StreamEpisodes | None = None):
        if source.rollout is None:
            raise ValueError("async_mode streaming needs rollout ranks of their own "
                             "(rollout.placement separate)")
        self.source, self.draw, self.stream = source, draw, stream
        self.groups_per_step, self.seed = groups_per_step, seed
        self.old_from_rollout, self.wait_timeout_s = old_from_rollout, wait_timeout_s
        self.episodes = episodes  # rollout.env: the samples' environments
        self.report_every_s = 60.0  # how often a long wait for the buffer prints its state
        self.pending: tuple[list, Any, int, float] | None = None  # requests, call, version
        self._last_counts = dict(stream.counts)
        self._rollout_busy_s = self._rollout_span_s = 0.0

    def next_batch(self, step: int, timer: SectionTimer) -> tuple[Batch, dict[str, float]]:
        """Step `step`'s groups (segments sampled until enough finished), after submitting the
        next segment, which samples while this step trains."""
        metrics: dict[str, float] = {}
        began = time.perf_counter()
        deadline, reported = began + self.wait_timeout_s, began
        syncs: list[dict[str, float]] = []
        with timer("wait_rollout"):  # the trainer's idle time: nothing it can train yet
            while True:
                now = time.perf_counter()
                if now > deadline:
                    raise TimeoutError(self._state(
                        f"waiting {self.wait_timeout_s:g} s for {self.groups_per_step} finished "
                        "groups in the buffer"))
                if now - reported >= self.report_every_s:  # a long wait says what it is
                    reported = now
                    print(self._state(f"step {step} has waited {now - began:.1f} s for "
                                      f"{self.groups_per_step} finished groups"), flush=True)
                self._collect()
                groups = self.stream.take(self.groups_per_step,
                                          version=self.source.policy_version)
                if groups:
                    break
                syncs.append(self._submit(timer))
                if self.pending is None:
                    raise RuntimeError(self._state("the prompt stream ran dry: no sample is "
                                                   "generating and the buffer is short"))
        syncs.append(self._submit(timer))
        # at most one sync a step (the policy changes once): its figures, else a skip
        metrics.update(next((s for s in syncs if s), SKIPPED_SYNC))
        batch = self._assemble(groups)
        batch, admit = self._admit(batch)
        metrics.update(admit)
        if self.episodes is not None:
            metrics.update(self.episodes.metrics([s for g in groups for s in g.samples],
                                                 truncated=metrics["env/truncated"]))
        metrics["async/trainer_wait_s"] = time.perf_counter() - began
        metrics["async/rollout_idle_s"] = max(0.0, self._rollout_span_s - self._rollout_busy_s)
        self._rollout_span_s = self._rollout_busy_s = 0.0
        return batch, metrics

    def _submit(self, timer: SectionTimer) -> dict[str, float]:
        """Sync the pool if the policy changed, start queued prompts, send one segment of every
        unfinished sample (non-blocking); returns the sync's metrics."""
        source, stream = self.source, self.stream
        sync = {}
        if source.held_version() != source.policy_version:
            with timer("sync_weights"):
                sync = source.sync()
        while len(stream.queue) < stream.slots // stream.n + 1:  # room to start a group
            stream.queue_prompts(self._rows(self.draw()))
        stream.start()
        version = source.rollout_version
        assert version is not None  # synced above
        requests = stream.requests(version=version)
        if not requests:
            return sync
        inputs = Batch({
            "input_ids": Ragged.from_list([r.input_ids for r in requests], dtype=torch.int64),
            "prompt_len": torch.tensor([r.prompt_len for r in requests], dtype=torch.int64),
            "max_tokens": torch.tensor([r.max_tokens for r in requests], dtype=torch.int64),
            "seed": torch.tensor([derive_seed(self.seed, *r.seed_parts) for r in requests],
                                 dtype=torch.int64)})
        assert source.rollout is not None  # checked when the pipeline was made
        call = source.rollout.generate_segments(inputs, blocking=False)
        self.pending = (requests, call, version, time.perf_counter())
        return sync

    def _collect(self) -> None:
        """Wait for the segment in flight (if any) and record it."""
        if self.pending is None:
            return
        requests, call, version, sent = self.pending
        try:
            out = call.get(timeout_s=self.wait_timeout_s)
        except Exception as e:  # the worker group names the ranks; the note, the stream
            e.add_note(self._state(f"waiting for rollout.generate_segments ({len(requests)} "
                                   f"samples, version {version})"))
            raise
        self.pending = None
        self._rollout_busy_s += out.meta.get("metrics", {}).get("rollout/seconds", 0.0)
        self._rollout_span_s += time.perf_counter() - sent
        segments = [Segment(ids.tolist(), lps.tolist(), "stop" if stopped else "length")
                    for ids, lps, stopped in zip(out["response_ids"].to_list(),
                                                 out["rollout_log_probs"].to_list(),
                                                 out["stopped"].tolist())]
        self.stream.record(requests, segments, version=version)
        if self.episodes is not None:
            self.episodes.play(self.stream)

    def _state(self, what: str) -> str:
        s = self.stream
        return (f"async_mode streaming: {what}; stream state: {s.ready()} groups buffered, "
                f"{s.busy_slots()} samples generating, {len(s.queue)} prompts queued, "
                f"{s.drawn} drawn, policy version {self.source.policy_version}, pool holds "
                f"{self.source.rollout_version}; raise trainer.stream_wait_timeout_s if the "
                "pool is only slow")

    @staticmethod
    def _rows(prompts: Batch) -> list[tuple[Batch, list[int]]]:
        prompts = Batch({k: prompts[k] for k in prompts.keys()})  # the loader's meta stays out
        return [(prompts.select([i]), prompts["prompt_ids"][i].tolist())
                for i in range(len(prompts))]

    def _assemble(self, groups: list) -> Batch:
        """The groups' prompts repeated per sample with their responses, per-token versions
        and sampler log-probs; `policy_version` = a sample's oldest token's version."""
        samples = [s for g in groups for s in g.samples]
        batch = Batch.concat([g.prompt for g in groups]).repeat_interleave(self.stream.n)
        if self.episodes is not None:  # the whole episode is one response, as multi-turn's
            batch = batch.union(Batch({
                MODEL_MASK: Ragged.from_list([s.model_mask for s in samples], dtype=torch.bool),
                "env_reward": torch.tensor([s.reward for s in samples], dtype=torch.float32)}))
        return batch.union(Batch({
            "response_ids": Ragged.from_list([s.tokens for s in samples], dtype=torch.int64),
            "rollout_log_probs": Ragged.from_list([s.log_probs for s in samples],
                                                  dtype=torch.float32),
            TOKEN_VERSIONS: Ragged.from_list([s.versions for s in samples], dtype=torch.int64),
            VERSION: torch.tensor([min(s.versions, default=0) for s in samples],
                                  dtype=torch.int64)}))

    def _admit(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The staleness of every token (the stream kept it within the bound) as quantiles
        and a histogram, the stream's state and what happened since the last step."""
        stream = self.stream
        staleness_T = (self.source.policy_version - batch[TOKEN_VERSIONS].values).float()
        if MODEL_MASK in batch:  # the model's tokens only: environment tokens train nothing
            staleness_T = staleness_T[batch[MODEL_MASK].values]
        counts = stream.counts
        delta = {k: counts[k] - self._last_counts.get(k, 0) for k in counts}
        self._last_counts = dict(counts)
        metrics = {"async/policy_version": float(self.source.policy_version),
                   "async/buffer_groups": float(stream.ready()),
                   "async/generating_samples": float(stream.busy_slots()),
                   "async/interrupted_samples": float(delta["interrupted"]),
                   "async/dropped_samples": float(delta["dropped_samples"]),
                   "async/regenerated_samples": float(delta["regenerated_samples"]),
                   "async/segments": float(delta["segments"])}
        if self.episodes is not None:
            metrics.update({"env/truncated": float(delta["env_truncated"]),
                            "env/restarted_samples": float(delta["env_restarts"])})
        if staleness_T.numel():
            for q in (0.5, 0.9, 1.0):
                metrics[f"async/token_staleness_p{int(q * 100)}"] = float(
                    staleness_T.quantile(q))
            for s in range(stream.max_staleness + 1):
                metrics[f"async/token_staleness_{s}"] = float((staleness_T == s).float().mean())
        if self.old_from_rollout:
            batch = batch.union(Batch({"old_log_probs": batch["rollout_log_probs"]}))
        return batch, metrics

    def state_dict(self) -> dict:
        """The stream (prompts queued, samples in flight with their tokens, buffered groups,
        every drawn prompt's fate) after the segment in flight is recorded, and the versions."""
        self._collect()
        return {"stream": self.stream.state_dict(), "source": self.source.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "stream" not in state:
            raise ValueError("this checkpoint was not written by an async_mode streaming run; "
                             "resume it with the trainer.async_mode it was trained with")
        self.source.load_state_dict(state["source"])
        self.stream.load_state_dict(state["stream"])
        self._last_counts = dict(self.stream.counts)
        if self.episodes is not None:  # this process holds none of their environments
            self.stream.restart_episodes()

    def close(self) -> None:
        """Stop the environments' worker processes (multi-turn)."""
        if self.episodes is not None:
            self.episodes.close()


def streaming_pipeline(cfg, source: RolloutSource, draw: Callable[[], Batch]) -> StreamingPipeline:
    """The StreamingPipeline of a JobConfig with trainer.async_mode streaming."""
    rollout = cfg.rollout
    if records_in_rollout(rollout):  # a sample's routes would span several segments' calls
        raise ConfigError("trainer.async_mode streaming does not keep vLLM's routed experts "
                          "(rollout.routing_replay=rollout) yet; use routing_replay=trainer "
                          "or async_mode one_step or bounded")
    t = cfg.trainer
    stream = RolloutStream(n=rollout.n,
                           slots=t.stream_slots or cfg.data.train_batch_size * rollout.n,
                           max_staleness=t.max_staleness, max_new_tokens=rollout.max_new_tokens,
                           segment_tokens=t.stream_segment_tokens, stale_policy=t.stale_policy,
                           env=rollout.env.path is not None, max_turns=rollout.max_turns,
                           max_response_tokens=rollout.max_response_tokens)
    return StreamingPipeline(source, draw, stream=stream,
                             groups_per_step=cfg.data.train_batch_size, seed=rollout.seed,
                             old_from_rollout=t.async_old_log_probs == "rollout",
                             wait_timeout_s=t.stream_wait_timeout_s,
                             episodes=stream_episodes(cfg) if stream.env else None)


def stream_episodes(cfg) -> StreamEpisodes:
    """The driver's environments of a streaming run with rollout.env: its worker processes,
    and the policy's tokenizer to decode turns and render observations (as the rollout ranks
    do for one_step and bounded, rlhf.rollout.multiturn)."""
    from transformers import AutoTokenizer

    from rlhf.envs.render import TurnRenderer
    from rlhf.envs.runner import EnvRunner

    env = cfg.rollout.env
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    renderer = TurnRenderer(tokenizer)
    return StreamEpisodes(EnvRunner(env.path, env.kwargs, num_workers=env.num_workers,
                                    timeout_s=env.timeout_s),
                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          render=renderer.ids, on_error=env.on_error,
                          fallback_reward=env.fallback_reward)
