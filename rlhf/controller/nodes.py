"""The cluster's nodes as the driver names them in messages, and small tasks pinned to each node:
the checks run before a job whose ranks span nodes starts (the interfaces its collectives
bootstrap over; the user files it imports).

On a loopback cluster every node has the same host name and address, so a label carries the
start of Ray's node id too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlhf.config import JobConfig
from rlhf.config.paths import is_file_target
from rlhf.config.schema import ALGORITHM_ENTRIES
from rlhf.errors import RLHFError
from rlhf.node_probes import import_each, interface_facts

logger = logging.getLogger(__name__)


def node_table() -> dict[str, dict]:
    """Ray's record of every node the cluster has known (alive or dead), by node id."""
    return {n["NodeID"]: n for n in ray.nodes()}


def node_label(node_id: str, table: dict[str, dict] | None = None) -> str:
    """'host address (node 1a2b3c4d)' for messages; the id alone when Ray no longer knows it."""
    entry = (node_table() if table is None else table).get(node_id)
    if entry is None:
        return f"node {node_id[:8]}"
    return f"{entry['NodeManagerHostname']} {entry['NodeManagerAddress']} (node {node_id[:8]})"


def node_alive(node_id: str, table: dict[str, dict] | None = None) -> bool:
    """Whether Ray still counts the node alive (a lost node turns dead after its health check)."""
    entry = (node_table() if table is None else table).get(node_id)
    return bool(entry and entry.get("Alive"))


def run_on_nodes(fn: Callable[..., Any], node_ids: Iterable[str], *args: Any,
                 timeout_s: float) -> dict[str, Any]:
    """{node id: fn(*args) run in a task on that node}. The tasks take no CPU, so they run
    beside a job whose ranks hold every CPU; RLHFError names a node whose task failed or did
    not finish within `timeout_s`."""
    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=node, soft=False)).remote(*args) for node in dict.fromkeys(node_ids)}
    ready, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    table = node_table()
    if late:
        nodes = ", ".join(node_label(n, table) for n, r in refs.items() if r in late)
        raise RLHFError(f"a check run on every node did not finish within {timeout_s:g} s "
                        f"on {nodes}")
    results = {}
    for node, ref in refs.items():
        try:
            results[node] = ray.get(ref)
        except ray.exceptions.RayError as e:
            raise RLHFError(f"a check run on {node_label(node, table)} failed: {e}") from None
    return results


# ---- code given by file path must import on every node hosting ranks ----

def user_files(cfg: JobConfig) -> dict[str, str]:
    """{config key: spec} of the reward functions, environment and algorithm entries given by
    file path."""
    specs = {f"reward.functions[{i}].path": fn.path for i, fn in enumerate(cfg.reward.functions)}
    specs |= {f"algorithm.{name}": getattr(cfg.algorithm, name) for name in ALGORITHM_ENTRIES}
    if cfg.rollout.env.path is not None:
        specs["rollout.env.path"] = cfg.rollout.env.path
    return {key: spec for key, spec in specs.items() if is_file_target(spec.rpartition(":")[0])}


def check_user_files(specs: dict[str, str], views: Mapping[str, Any], *,
                     timeout_s: float) -> None:
    """RLHFError naming each node and config key whose file (`specs`: key -> spec) does not
    import on a node hosting ranks of `views`; nothing runs when `specs` is empty."""
    if not specs:
        return
    nodes = [node for view in views.values() for node in view.group.rank_nodes]
    found = run_on_nodes(import_each, nodes, specs, timeout_s=timeout_s)
    table = node_table()
    problems = [f"on {node_label(node, table)}: {key}: {text}"
                for node, errors in found.items() for key, text in errors.items()]
    if problems:
        raise RLHFError("reward, environment or algorithm code given by file path does not import on "
                        "every node that runs the job; put the file on a file system every node "
                        "mounts at the same path, or ship it with `ray job submit "
                        "--working-dir`:\n" + "\n".join(problems))
    logger.info("%s import on %s", ", ".join(specs.values()),
                "; ".join(node_label(n, table) for n in found))


# ---- the interfaces a world spanning nodes bootstraps over -----------------------------------

# The variables each backend's cross-node bootstrap reads. A CUDA job's ranks run NCCL, and the
# vLLM engine inside them builds gloo groups over the same ranks, so it needs both.
INTERFACE_VARIABLES = {"gloo": ("GLOO_SOCKET_IFNAME",),
                       "nccl": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}


def interface_problems(env: Mapping[str, str], interfaces: Iterable[str], *,
                       backend: str) -> list[str]:
    """What is wrong with one node's interface variables (`env`) for a `backend` world that
    spans nodes, given the node's interface names: each variable unset, or matching none."""
    have = sorted(interfaces)
    problems = []
    for name in INTERFACE_VARIABLES[backend]:
        value = env.get(name, "").strip()
        if not value:
            problems.append(f"{name} is not set (interfaces there: {', '.join(have)})")
        elif not _matches(name, value, have):
            problems.append(f"{name}={value} names no interface of that node (interfaces there: "
                            f"{', '.join(have)})")
    return problems


def _matches(name: str, value: str, interfaces: list[str]) -> bool:
    """Whether `value` selects an interface the way its reader does: gloo takes exact names;
    NCCL takes name prefixes, exact names after "=", and names to avoid after "^"."""
    if name.startswith("GLOO"):
        return all(part.strip() in interfaces for part in value.split(","))
    exclude = value.startswith("^")
    value = value.lstrip("^")
    exact = value.startswith("=")
    parts = [p.strip() for p in value.lstrip("=").split(",") if p.strip()]
    chosen = [i for i in interfaces
              if any(i == p if exact else i.startswith(p) for p in parts) != exclude]
    return bool(chosen)


def check_node_interfaces(node_ids: Iterable[str], *, backend: str, timeout_s: float) -> None:
    """RLHFError naming each node and variable when ranks on `node_ids` span several nodes and
    a node lacks an interface variable `backend` needs (INTERFACE_VARIABLES) or names an
    interface it does not have; one-node groups are not checked."""
    nodes = list(dict.fromkeys(node_ids))
    if len(nodes) < 2:
        return
    variables = INTERFACE_VARIABLES[backend]
    # Run as tasks of this job, so they see the environment the ranks will: the node's
    # `ray start` plus the job's runtime_env.
    found = run_on_nodes(interface_facts, nodes, variables, timeout_s=timeout_s)
    table = node_table()
    problems = [f"on {node_label(node, table)}: {problem}"
                for node, (env, names) in found.items()
                for problem in interface_problems(env, names, backend=backend)]
    if problems:
        raise RLHFError(
            f"the job's {backend} ranks span {len(nodes)} nodes; their collectives connect over "
            f"the interfaces that {' and '.join(variables)} name, which every node must set:\n"
            + "\n".join(problems) + "\nSet the variable on that node before `ray start` (Ray's "
            f"workers inherit its environment), e.g. `export {variables[0]}=eth0` with the "
            "interface that reaches the other nodes (`ip -br addr` lists them), then restart "
            "Ray there: `ray stop && ray start ...`")
    logger.info("network interfaces: %s", "; ".join(
        f"{' '.join(f'{v}={env[v]}' for v in variables)} on {node_label(node, table)}"
        for node, (env, _) in found.items()))
