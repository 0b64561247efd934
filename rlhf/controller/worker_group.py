"""WorkerGroup: one Ray actor per rank of a ResourcePool, driven as if it were one program.

    group = WorkerGroup(pool, {"actor": ActorRole, "critic": (CriticRole, {"lr": 1e-5})},
                        job_name="ppo")
    critic_wg = group.role_views()["critic"]
    values = critic_wg.compute_values(batch)             # blocks, returns the collected result
    pending = critic_wg.update(batch, blocking=False)    # returns at once; pending.get() later

Failures: the driver waits on every rank's result at once and raises WorkerError at the first
failure, with job, role, rank, method and the remote traceback; a rank whose process died is
named with its node and the ranks that shared it (a lost node takes them all). After a
failure, the other ranks get `error_grace_s` to finish; ranks still running then are taken to
be stuck (in a collective waiting for the failed rank), and a dead process can never rejoin its
torch.distributed world, so in both cases the whole group is killed (its pool is kept until
`shutdown()`) and later calls raise at once. A failure that every rank finishes from (say, a
bad argument raising on all ranks) leaves the group usable.
"""

from __future__ import annotations

import inspect
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf.controller.colocate import ColocatedWorker
from rlhf.controller.dispatch import (
    CallRouting,
    Dispatch,
    Layout,
    collect,
    registered_methods,
    route_call,
)
from rlhf.controller.errors import WorkerDiedError, WorkerError
from rlhf.controller.nodes import check_node_interfaces, node_alive, node_label, node_table
from rlhf.controller.resource_pool import ResourcePool
from rlhf.controller.warm import WARM
from rlhf.trace import ProcessSpans, clock_offset, now_us

RoleSpec = type | tuple[type, Mapping[str, Any]]
logger = logging.getLogger(__name__)


class WorkerGroup:
    """One actor per rank of `pool`, each hosting the role objects of `roles` (name -> class or
    (class, kwargs)), built after torch.distributed is initialised over the pool's ranks.

    Actors are named `<job_name>/<role+role+...>:<rank>` (in Ray; kept processes taken under
    rlhf.controller.warm only in their log lines). With a single role the group itself
    exposes that role's methods; with several, use `role_views()`.
    """

    def __init__(
        self,
        pool: ResourcePool,
        roles: Mapping[str, RoleSpec],
        *,
        job_name: str,
        backend: str | None = None,
        init_timeout_s: float = 300.0,
        collective_timeout_s: float = 1800.0,
        error_grace_s: float = 2.0,
    ):
        self.pool, self.job_name = pool, job_name
        self._specs = _normalise_roles(roles)
        self._label = "+".join(self._specs)
        self._grace_s = error_grace_s
        self._dead_reason: str | None = None
        self._actors: list[ray.actor.ActorHandle] = []
        self._warm = WARM.serves(pool)  # kept processes (rlhf.controller.warm), unnamed
        backend = backend or ("nccl" if pool.use_gpu else "gloo")
        try:
            # Before any rank starts: a world spanning nodes hangs in its first collective
            # when a node bootstraps over the wrong interface.
            check_node_interfaces(pool.node_ids(), backend=backend, timeout_s=init_timeout_s)
            self._start_actors()
            # Kept from the start: after a node is lost, Ray may move the pool's bundles.
            self.rank_nodes = pool.node_ids()
            self.layouts = self._init_ranks(backend, init_timeout_s, collective_timeout_s)
        except BaseException:
            self._kill("the worker group failed to start")  # the caller still owns the pool
            raise
        self._views = {name: RoleView(self, name, cls, self.layouts[name])
                       for name, (cls, _) in self._specs.items()}
        table = node_table()
        logger.info("job '%s' group '%s': %s", job_name, self._label, "; ".join(
            f"ranks {self._ranks_on(node)} on {node_label(node, table)}"
            for node in dict.fromkeys(self.rank_nodes)))

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @property
    def actor_names(self) -> list[str]:
        return [self._actor_name(r) for r in range(self.world_size)]

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        return list(self._actors)

    def role_views(self) -> dict[str, RoleView]:
        """One view per role: its registered methods, dispatched with that role's layout."""
        return dict(self._views)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or "_views" not in self.__dict__:
            raise AttributeError(name)
        if len(self._views) != 1:
            raise AttributeError(f"worker group '{self._label}' hosts roles {list(self._views)}; "
                                 f"call methods on group.role_views()[role].{name}")
        return getattr(next(iter(self._views.values())), name)

    def shutdown(self, *, remove_pool: bool = True) -> None:
        """Kill every rank's actor (or keep it warm, rlhf.controller.warm) and (by default)
        remove the pool's placement groups."""
        if self._warm and self._dead_reason is None:
            self._dead_reason = "the worker group was shut down"
            WARM.give_back(self._actors)
            self._actors = []
        self._kill("the worker group was shut down")
        if remove_pool:
            self.pool.remove()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def take_spans(self, *, record: bool, pings: int = 3) -> list[ProcessSpans]:
        """Each rank's timeline spans since the last call, with its clock's offset to this
        process (`pings` round trips each, the shortest counts); then each rank records on
        only if `record` (trainer.trace decides which steps)."""
        self._check_alive(self._label, "take_spans")
        clocks = []
        for actor in self._actors:
            samples = []
            for _ in range(pings):  # one at a time: a ping that queues behind another is slow
                sent = now_us()
                remote = ray.get(actor.trace_clock.remote())
                samples.append((sent, remote, now_us()))
            clocks.append(clock_offset(samples) if samples else (0, 0))
        spans = ray.get([actor.take_spans.remote(record) for actor in self._actors])
        return [ProcessSpans(self._actor_name(rank).removeprefix(f"{self.job_name}/"),
                             spans[rank], *clocks[rank]) for rank in range(len(self._actors))]

    # ---- start-up ----------------------------------------------------------------------------

    def _actor_name(self, rank: int) -> str:
        return f"{self.job_name}/{self._label}:{rank}"

    def _start_actors(self) -> None:
        if self._warm:
            threads = int(self.pool.bundle["CPU"])
            self._actors = WARM.take(self.pool.world_size, threads=threads)
            self._wait({rank: actor.adopt.remote(
                self.job_name, self._specs, name=self._actor_name(rank),
                num_threads=threads, use_gpu=False)
                for rank, actor in enumerate(self._actors)}, self._label, "adopt")
            return
        remote_cls = ray.remote(ColocatedWorker)
        for rank in range(self.pool.world_size):
            pg, index = self.pool.bundle_of(rank)
            options = dict(
                name=self._actor_name(rank),
                num_cpus=self.pool.bundle["CPU"],
                num_gpus=self.pool.bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index),
            )
            try:
                actor = remote_cls.options(**options).remote(
                    self.job_name, self._specs, name=self._actor_name(rank),
                    num_threads=int(self.pool.bundle["CPU"]), use_gpu=self.pool.use_gpu)
            except ValueError as e:  # Ray refuses a name that a live actor holds
                raise ValueError(f"cannot start {self._actor_name(rank)}: {e}; another worker "
                                 "group with this job_name and roles is running: shut it down "
                                 "or use another job_name") from e
            self._actors.append(actor)

    def _init_ranks(self, backend: str, timeout_s: float, pg_timeout_s: float) -> dict[str, Layout]:
        """Rendezvous on rank 0's store, create the default group on every rank, build roles."""
        n = self.world_size
        addr, port = self._wait({0: self._actors[0].open_store.remote(pg_timeout_s)},
                                self._label, "open_store", timeout_s)[0]
        inits = {r: a.init_distributed.remote(r, n, addr, port, backend, pg_timeout_s)
                 for r, a in enumerate(self._actors)}
        self._wait(inits, self._label, "init_distributed", timeout_s)
        per_rank = self._wait({r: a.build_roles.remote() for r, a in enumerate(self._actors)},
                              self._label, "build_roles", timeout_s)
        for rank in range(1, n):
            if per_rank[rank] != per_rank[0]:
                raise ValueError(f"job '{self.job_name}': rank {rank} reports layouts "
                                 f"{per_rank[rank]} but rank 0 reports {per_rank[0]}; every rank "
                                 "must build its roles with the same parallel layout")
        # per rank on a GPU, {} on the CPU: what its NCCL communicators took as they were made
        self.communicator_metrics = self._wait(
            {r: a.communicator_metrics.remote() for r, a in enumerate(self._actors)},
            self._label, "communicator_metrics", timeout_s)
        for rank, metrics in self.communicator_metrics.items():
            if metrics:
                logger.info("job '%s' group '%s' rank %d: %s", self.job_name, self._label, rank,
                            ", ".join(f"{k}={v:g}" for k, v in metrics.items()))
        return per_rank[0]

    # ---- calls -------------------------------------------------------------------------------

    def _submit(self, role: str, method: str, mode: Dispatch, args: tuple,
                kwargs: dict) -> PendingCall:
        self._check_alive(role, method)
        layout = self.layouts[role]
        routing = route_call(mode, layout, args, kwargs)
        refs = {rank: self._actors[rank].call.remote((role, method, routing.keep[rank]),
                                                     *call[0], **call[1])
                for rank, call in enumerate(routing.args) if call is not None}
        return PendingCall(self, role, method, mode, layout, routing, refs)

    def _wait(self, refs: dict[int, ray.ObjectRef], role: str, method: str,
              timeout_s: float | None = None) -> dict[int, Any]:
        """{rank: result}; raises WorkerError at the first failure instead of waiting in order."""
        self._check_alive(role, method)
        pending = {ref: rank for rank, ref in refs.items()}
        results: dict[int, Any] = {}
        failures: list[tuple[int, Exception]] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending and not failures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left, fetch_local=False)
            if not ready:
                stuck = sorted(pending.values())
                self._kill(f"ranks {stuck} did not finish '{method}' within {timeout_s:g} s")
                raise WorkerError(f"job '{self.job_name}' role '{role}': ranks {stuck} did not "
                                  f"finish '{method}' within {timeout_s:g} s (a hang?); the worker "
                                  "group was shut down", job=self.job_name, role=role,
                                  rank=stuck[0], method=method)
            _take(ready, pending, results, failures)
        if failures:
            if pending:  # a dead peer's own error often lands just after its peers' errors
                ready, _ = ray.wait(list(pending), num_returns=len(pending),
                                    timeout=self._grace_s, fetch_local=False)
                _take(ready, pending, results, failures)
            raise self._failure(role, method, failures, sorted(pending.values()))
        return results

    def _failure(self, role: str, method: str, failures: list[tuple[int, Exception]],
                 still_running: list[int]) -> WorkerError:
        deaths = [(r, e) for r, e in failures if not isinstance(e, RayTaskError)]
        rank, exc = (deaths or failures)[0]
        where = f"job '{self.job_name}' role '{role}' rank {rank} ({self._actor_name(rank)})"
        if deaths:
            head = (f"{where}: process died while running '{method}' (killed, out of memory, "
                    f"exited, or failed to start){self._node_of(rank)}")
            remote = _plain(str(exc))
        else:
            remote = _plain(getattr(exc, "traceback_str", None) or str(exc))
            cause = getattr(exc, "cause", None)  # None when the exception did not unpickle
            last_line = remote.strip().splitlines()[-1] if remote.strip() else "an error"
            summary = f"{type(cause).__name__}: {cause}" if cause else last_line
            head = f"{where} raised in '{method}': {summary}"
        notes = []
        others = sorted(r for r, _ in failures if r != rank)
        if others:
            notes.append(f"ranks {others} failed too")
        if deaths or still_running:
            why = "a rank died" if deaths else (
                f"ranks {still_running} were still running (probably waiting in a collective "
                "for the failed rank)")
            notes.append(f"{why}, so the worker group was shut down")
            self._kill(head)
        message = f"{head}{'; ' if notes else ''}{'; '.join(notes)}\n--- remote ---\n{remote}"
        cls = WorkerDiedError if deaths else WorkerError
        return cls(message, job=self.job_name, role=role, rank=rank, method=method,
                   remote_traceback=remote)

    def _ranks_on(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.rank_nodes) if n == node]

    def _node_of(self, rank: int) -> str:
        """Where a dead rank ran, with the ranks that shared its node: when the node itself
        was lost, they all went with it."""
        nodes = getattr(self, "rank_nodes", None)
        if not nodes:
            return ""
        table, node = node_table(), nodes[rank]
        text = f"; it ran on {node_label(node, table)} (ranks {self._ranks_on(node)} there)"
        if not node_alive(node, table):
            text += ("; Ray reports that node dead (node lost: its raylet stopped or the "
                     "machine went away), so resume from the last checkpoint once it is back")
        return text

    def _kill(self, reason: str) -> None:
        if self._dead_reason is None:
            self._dead_reason = reason
        for actor in getattr(self, "_actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass

    def _check_alive(self, role: str, method: str) -> None:
        if self._dead_reason is not None:
            raise WorkerError(f"job '{self.job_name}' worker group '{self._label}' is not running "
                              f"(cannot call '{method}'): {self._dead_reason}",
                              job=self.job_name, role=role, rank=None, method=method)


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # Ray colours its tracebacks for terminals


def _take(ready: list[ray.ObjectRef], pending: dict[ray.ObjectRef, int],
          results: dict[int, Any], failures: list[tuple[int, Exception]]) -> None:
    for ref in ready:
        rank = pending.pop(ref)
        try:
            results[rank] = ray.get(ref)
        except RayError as exc:  # a task error (RayTaskError) or a lost process (RayActorError)
            failures.append((rank, exc))


class PendingCall:
    """A call in flight on a role's ranks; `get()` collects it (once; later calls reuse it)."""

    def __init__(self, group: WorkerGroup, role: str, method: str, mode: Dispatch,
                 layout: Layout, routing: CallRouting, refs: dict[int, ray.ObjectRef]):
        self._group, self._role, self._method = group, role, method
        self._mode, self._layout, self._routing, self._refs = mode, layout, routing, refs
        self._done, self._value = False, None

    def done(self) -> bool:
        """Whether every rank has finished (successfully or not); never blocks."""
        ready, _ = ray.wait(list(self._refs.values()), num_returns=len(self._refs), timeout=0,
                            fetch_local=False)
        return len(ready) == len(self._refs)

    def get(self, timeout_s: float | None = None) -> Any:
        """The collected result; a timeout counts as a hang and shuts the group down."""
        if not self._done:
            results = self._group._wait(self._refs, self._role, self._method, timeout_s)
            self._value = collect(self._mode, self._layout, self._routing, results)
            self._done, self._refs = True, {}
        return self._value


class RoleView:
    """The driver's handle on one role of a worker group: `view.method(*args, blocking=True)`."""

    def __init__(self, group: WorkerGroup, name: str, role_cls: type, layout: Layout):
        self.group, self.name, self.layout = group, name, layout
        self.methods = registered_methods(role_cls)
        for method in self.methods:
            if "blocking" in inspect.signature(getattr(role_cls, method)).parameters:
                raise TypeError(f"{role_cls.__name__}.{method} has a parameter named 'blocking', "
                                "which WorkerGroup calls reserve; rename it")

    def __getattr__(self, name: str) -> Any:
        methods = self.__dict__.get("methods", {})
        if name not in methods:
            raise AttributeError(f"role '{self.__dict__.get('name')}' has no method '{name}' "
                                 f"registered with @register; registered: {sorted(methods)}")
        return _RemoteMethod(self, name, methods[name])

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.methods))

    def __repr__(self) -> str:
        lay = self.layout
        return (f"RoleView({self.group.job_name}/{self.name}: dp={lay.dp} pp={lay.pp} tp={lay.tp}, "
                f"methods={sorted(self.methods)})")


class _RemoteMethod:
    def __init__(self, view: RoleView, name: str, mode: Dispatch):
        self._view, self._name, self._mode = view, name, mode

    def __call__(self, *args: Any, blocking: bool = True, **kwargs: Any) -> Any:
        pending = self._view.group._submit(self._view.name, self._name, self._mode, args, kwargs)
        return pending.get() if blocking else pending


def _normalise_roles(roles: Mapping[str, RoleSpec]) -> dict[str, tuple[type, dict]]:
    if not roles:
        raise ValueError("a worker group needs at least one role: {name: RoleClass or "
                         "(RoleClass, kwargs)}")
    out = {}
    for name, spec in roles.items():
        cls, kwargs = (spec, {}) if isinstance(spec, type) else spec
        if not isinstance(cls, type) or not isinstance(kwargs, Mapping):
            raise TypeError(f"role '{name}': expected a class or (class, kwargs), got {spec!r}")
        if not name or any(c in name for c in "/:+"):
            raise ValueError(f"role name {name!r} must be non-empty without '/', ':' or '+' "
                             "(they separate parts of actor names)")
        out[name] = (cls, dict(kwargs))
    return out
