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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf.controller import RoleView
from rlhf.data.batch import Batch
from rlhf.trainer.metrics import SectionTimer

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
    call: object | None  # PendingCall; None once `out` is known
    out: Batch | None = None

    def result(self) -> Batch:
        if self.out is None:
            self.out, self.call = self.call.get(), None
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
