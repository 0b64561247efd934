"""Warm ranks: rank processes kept by the driver between worker groups, so that a later group
skips starting Python and importing torch, Ray and vLLM (about 7 s of CPU per rank), which
on a small CPU machine costs more than a tiny model's whole job.

Off unless `keep_ranks_warm()` turns it on (the test suite does, for its shared cluster).
Only CPU groups on a one-node cluster take part: a kept process lives outside the group's
placement group (removing that group would kill it), so it holds no resources of its own
(num_cpus=0) while the pool's bundles keep the reservation, and only on one node is the
process where the bundle is. Such ranks are unnamed in Ray (a name cannot change), and a
process is kept only when its group shut down cleanly and `ColocatedWorker.release` found
nothing left of the roles; any other is killed, as without warm ranks. A process that hosted
a vLLM CPU engine keeps that engine's torch thread count (`ColocatedWorker.fixed_threads`) and
serves only groups whose ranks use as many threads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray.exceptions import RayError

from rlhf.controller.colocate import ColocatedWorker, runs_threads
from rlhf.controller.resource_pool import ResourcePool

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 60.0


class WarmRanks:
    """The driver's idle rank processes; `take` for a new group, `give_back` at its shutdown."""

    def __init__(self) -> None:
        self.enabled = False
        self.max_idle = 0
        self._idle: list[ray.actor.ActorHandle] = []

    def serves(self, pool: ResourcePool) -> bool:
        """Whether a group on `pool` takes warm ranks."""
        if not self.enabled or pool.use_gpu:
            return False
        return sum(1 for n in ray.nodes() if n.get("Alive")) == 1

    def take(self, n: int, *, threads: int) -> list[ray.actor.ActorHandle]:
        """`n` rank processes for ranks of `threads` torch threads: idle ones that still
        answer and can run that many threads first (`ColocatedWorker.fixed_threads`), the
        last given back first, then new ones (unnamed, no resources). Idle processes held to
        another thread count stay idle for a later group."""
        taken: list[ray.actor.ActorHandle] = []
        left: list[ray.actor.ActorHandle] = []
        for actor in reversed(self._idle):
            if len(taken) == n:
                left.append(actor)
                continue
            fixed = _fixed_threads(actor)
            if fixed is _DEAD:
                continue
            (taken if runs_threads(fixed, threads) else left).append(actor)
        self._idle = left[::-1]
        remote_cls = ray.remote(ColocatedWorker)
        while len(taken) < n:
            taken.append(remote_cls.options(num_cpus=0).remote(
                "", {}, name="warm rank", num_threads=threads, use_gpu=False))
        return taken

    def give_back(self, actors: list[ray.actor.ActorHandle]) -> None:
        """Keep each process whose roles released cleanly (up to `max_idle`); kill the rest."""
        refs = {actor.release.remote(): actor for actor in actors}
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=RELEASE_TIMEOUT_S)
        for ref in ready:
            actor = refs[ref]
            try:
                left = ray.get(ref)
            except RayError as e:
                left = str(e)
            if left is None and len(self._idle) < self.max_idle:
                self._idle.append(actor)
                continue
            if left is not None:
                logger.info("not keeping a rank process warm: %s", left)
            _kill(actor)
        for ref in late:
            _kill(refs[ref])

    def close(self) -> None:
        """Kill every idle process."""
        for actor in self._idle:
            _kill(actor)
        self._idle = []


_DEAD = object()


def _fixed_threads(actor: ray.actor.ActorHandle) -> object:
    """The idle process's `fixed_threads`, or _DEAD (then killed) when it does not answer."""
    try:
        return ray.get(actor.fixed_threads.remote(), timeout=RELEASE_TIMEOUT_S)
    except Exception:  # died while idle (killed, out of memory): start another
        _kill(actor)
        return _DEAD


def _kill(actor: ray.actor.ActorHandle) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead
        pass


WARM = WarmRanks()


@contextmanager
def keep_ranks_warm(max_idle: int = 8) -> Iterator[WarmRanks]:
    """Within: CPU worker groups on a one-node cluster reuse up to `max_idle` rank processes
    left by groups shut down before them. After: the idle ones are killed. Inside an outer
    `keep_ranks_warm` it changes nothing: the outer one keeps the processes."""
    if WARM.enabled:
        yield WARM
        return
    WARM.enabled, WARM.max_idle = True, max_idle
    try:
        yield WARM
    finally:
        WARM.enabled, WARM.max_idle = False, 0
        WARM.close()


@contextmanager
def cold_ranks() -> Iterator[None]:
    """Within: new worker groups start processes of their own (named actors in their
    placement groups), even under `keep_ranks_warm`."""
    enabled, WARM.enabled = WARM.enabled, False
    try:
        yield
    finally:
        WARM.enabled = enabled
