"""Before the first step: does every node see what the driver sees?

Checkpoints and exports are written by the workers on their own nodes into a folder the driver
created. When that folder is not on a file system every node mounts, each node would write its
shards into a local folder of the same name and the checkpoint would never be whole. The
driver writes a marker file with a fresh token; every rank reads it back (`read_marker`, a
worker method) and the job stops at once, naming the nodes that do not see it.

Reward functions and environments given as 'path/to/file.py:name' must import on every node
that hosts ranks (`check_user_files`), for the same reason.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import ray

from rlhf.config import JobConfig
from rlhf.config.paths import is_file_target
from rlhf.controller import RoleView
from rlhf.controller.nodes import node_label, node_table, run_on_nodes
from rlhf.errors import RLHFError

MARKER_PREFIX = ".rlhf-shared-folder-"

Reader = Callable[[str], Sequence[tuple[str, str | None]]]  # path -> (node, text) per rank
logger = logging.getLogger(__name__)


def read_marker(path: str) -> tuple[str, str | None]:
    """(this node's name, the text of `path` as this process sees it, or None)."""
    node = socket.gethostname()
    if ray.is_initialized():  # nodes of one machine (a loopback cluster) share the host name
        node += f" (node {ray.get_runtime_context().get_node_id()[:8]})"
    try:
        return node, Path(path).read_text()
    except OSError:
        return node, None


def check_shared_folder(folder: str | Path, readers: dict[str, Reader]) -> None:
    """RLHFError naming the nodes (and the roles whose ranks run there) that cannot read a
    marker written into `folder`; `readers` maps a role to its ranks' `read_marker`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    marker = folder / f"{MARKER_PREFIX}{token}"
    marker.write_text(token)
    seen: set[str] = set()
    try:
        blind: dict[str, set[str]] = {}
        for role, reader in readers.items():
            for node, text in reader(str(marker)):
                seen.add(node)
                if text != token:
                    blind.setdefault(node, set()).add(role)
    finally:
        marker.unlink(missing_ok=True)
    if blind:
        nodes = "; ".join(f"{node} ({', '.join(sorted(roles))})"
                          for node, roles in sorted(blind.items()))
        raise RLHFError(f"trainer.output_dir {folder} is not shared with every node: {nodes} "
                        "cannot read the file the driver wrote there, so their checkpoint "
                        "shards would land in a different folder. Put trainer.output_dir on a "
                        "file system every node mounts (NFS, a shared volume) at the same path")
    logger.info("trainer.output_dir %s is shared: read back on %s", folder,
                "; ".join(sorted(seen)))


def user_files(cfg: JobConfig) -> dict[str, str]:
    """{config key: spec} of the reward functions and environment given by file path."""
    specs = {f"reward.functions[{i}].path": fn.path for i, fn in enumerate(cfg.reward.functions)}
    if cfg.rollout.env.path is not None:
        specs["rollout.env.path"] = cfg.rollout.env.path
    return {key: spec for key, spec in specs.items() if is_file_target(spec.rpartition(":")[0])}


def check_user_files(specs: dict[str, str], views: Mapping[str, RoleView], *,
                     timeout_s: float) -> None:
    """RLHFError naming each node and config key whose file (`specs`: key -> spec) does not
    import on a node hosting ranks of `views`; nothing runs when `specs` is empty."""
    if not specs:
        return
    nodes = [node for view in views.values() for node in view.group.rank_nodes]
    found = run_on_nodes(_import_each, nodes, specs, timeout_s=timeout_s)
    table = node_table()
    problems = [f"on {node_label(node, table)}: {key}: {text}"
                for node, errors in found.items() for key, text in errors.items()]
    if problems:
        raise RLHFError("reward or environment code given by file path does not import on "
                        "every node that runs the job; put the file on a file system every node "
                        "mounts at the same path, or ship it with `ray job submit "
                        "--working-dir`:\n" + "\n".join(problems))
    logger.info("%s import on %s", ", ".join(specs.values()),
                "; ".join(node_label(n, table) for n in found))


def _import_each(specs: dict[str, str]) -> dict[str, str]:
    """{key: error} for the specs that do not import in this process."""
    from rlhf.rewards.loader import load_object

    errors = {}
    for key, spec in specs.items():
        try:
            load_object(spec, what="environment" if key.startswith("rollout") else
                        "reward function")
        except RLHFError as e:
            errors[key] = str(e)
    return errors
