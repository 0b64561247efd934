"""ResourcePool: one placement-group bundle per rank, ranks packed node by node.

Placement: one STRICT_PACK placement group per node entry of `ranks_per_node`. Ranks of one
entry are consecutive, so tensor-parallel groups (runs of consecutive ranks) stay on one
machine, and rank -> node is predictable. A single PACK group over all bundles would be
allowed to scatter any bundle to any node whenever packing is not possible, silently putting
a TP group across the network. Two entries may share a node that has room for both.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rlhf.controller.errors import ResourceError


class ResourcePool:
    """Ranks 0..world_size-1 as placement-group bundles: node 0's ranks first, then node 1's, ...

    Each bundle is {"CPU": cpus_per_rank}, plus {"GPU": 1} when `use_gpu`. Creating the pool
    waits up to `timeout_s` for the cluster to grant every bundle and raises ResourceError
    naming what is missing.
    """

    def __init__(
        self,
        name: str,
        *,
        ranks_per_node: list[int] | int,
        nnodes: int | None = None,
        use_gpu: bool,
        cpus_per_rank: int = 1,
        timeout_s: float = 60.0,
    ):
        self.name = name
        self.use_gpu = use_gpu
        self.ranks_per_node = _node_counts(ranks_per_node, nnodes)
        self.bundle = rank_bundle(cpus_per_rank=cpus_per_rank, use_gpu=use_gpu)
        _check_feasible(name, self.ranks_per_node, self.bundle)
        self._pgs: list[PlacementGroup] = [
            placement_group([dict(self.bundle)] * n, strategy="STRICT_PACK", name=f"{name}:node{i}")
            for i, n in enumerate(self.ranks_per_node)
        ]
        self._bundles = [(pg, j) for pg, n in zip(self._pgs, self.ranks_per_node) for j in range(n)]
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.remove()
            raise

    @property
    def world_size(self) -> int:
        return len(self._bundles)

    @property
    def placement_groups(self) -> list[PlacementGroup]:
        return list(self._pgs)

    def bundle_of(self, rank: int) -> tuple[PlacementGroup, int]:
        """(placement group, bundle index) that hosts `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside pool '{self.name}' "
                             f"(ranks 0..{self.world_size - 1})")
        return self._bundles[rank]

    def node_ids(self) -> list[str]:
        """Ray node id hosting each rank, in rank order."""
        tables = [ray.util.placement_group_table(pg)["bundles_to_node_id"] for pg in self._pgs]
        return [tables[self._pgs.index(pg)][j] for pg, j in self._bundles]

    def remove(self) -> None:
        """Give the bundles back to the cluster (kill the pool's actors first); idempotent."""
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed, or the cluster is gone
                pass
        self._pgs, self._bundles = [], []

    def _wait_ready(self, timeout_s: float) -> None:
        refs = {pg.ready(): i for i, pg in enumerate(self._pgs)}
        _, not_ready = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        if not not_ready:
            return
        waiting = ", ".join(f"{self.name}:node{refs[r]}" for r in not_ready)
        raise ResourceError(
            f"resource pool '{self.name}': placement groups {waiting} not ready after "
            f"{timeout_s:g} s. Each node entry needs its bundles on ONE node "
            f"({_per_node_text(self.ranks_per_node, self.bundle)}); the cluster has "
            f"{_fmt(ray.cluster_resources())} in total and {_fmt(ray.available_resources())} "
            "free now (other pools or actors hold the rest). Free resources, lower "
            "ranks_per_node, or raise timeout_s."
        )


def rank_bundle(*, cpus_per_rank: int, use_gpu: bool) -> dict[str, float]:
    """One rank's placement-group bundle; its CPUs are also the rank's torch threads
    (WorkerGroup hands them to ColocatedWorker)."""
    if cpus_per_rank < 1:
        raise ValueError(f"cpus_per_rank must be at least 1, got {cpus_per_rank}")
    return {"CPU": cpus_per_rank, **({"GPU": 1} if use_gpu else {})}


def _node_counts(ranks_per_node: list[int] | int, nnodes: int | None) -> list[int]:
    if isinstance(ranks_per_node, int):
        counts = [ranks_per_node] * (1 if nnodes is None else nnodes)
    else:
        counts = list(ranks_per_node)
        if nnodes is not None and nnodes != len(counts):
            raise ValueError(f"nnodes={nnodes} but ranks_per_node lists {len(counts)} nodes "
                             f"({counts}); give one entry per node or drop nnodes")
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"ranks_per_node must be positive ints (one per node), got {counts}")
    return counts


def _check_feasible(name: str, counts: list[int], bundle: dict[str, float]) -> None:
    """Fail at once when no waiting could help: a node entry larger than every node, or a
    pool larger than the whole cluster."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    for key, per_rank in bundle.items():
        need = per_rank * sum(counts)
        if total.get(key, 0) < need:
            raise ResourceError(
                f"resource pool '{name}' needs {need:g} {key} ({sum(counts)} ranks x "
                f"{per_rank:g}) but the cluster has {total.get(key, 0):g} {key} in total; "
                f"add nodes or lower ranks_per_node / cpus_per_rank")
    for i, n in enumerate(counts):
        need = {k: v * n for k, v in bundle.items()}
        if not any(all(res.get(k, 0) >= v for k, v in need.items()) for res in nodes):
            biggest = max(nodes, key=lambda r: r.get("GPU" if "GPU" in bundle else "CPU", 0))
            raise ResourceError(
                f"resource pool '{name}': node entry {i} needs {_fmt(need)} on one node "
                f"({n} ranks x {_fmt(bundle)}) but the largest node has "
                f"{_fmt({k: biggest.get(k, 0) for k in bundle})}; spread the ranks over more "
                "nodes (ranks_per_node as a list) or use bigger nodes")


def _per_node_text(counts: list[int], bundle: dict[str, float]) -> str:
    return "; ".join(f"node {i}: {_fmt({k: v * n for k, v in bundle.items()})}"
                     for i, n in enumerate(counts))


def _fmt(resources: dict[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU") if k in resources]
    return "{" + ", ".join(f"{k}: {resources[k]:g}" for k in keys) + "}"
