"""Before the first checkpoint: does every node see the output folder the driver writes into?

Checkpoints and exports are written by the workers on their own nodes into a folder the driver
created. When that folder is not on a file system every node mounts, each node would write its
shards into a local folder of the same name and the checkpoint would never be whole. The
driver writes a marker file with a fresh token; every rank reads it back (`read_marker`, a
worker method) and the job stops at once, naming the nodes that do not see it.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from rlhf.errors import RLHFError

MARKER_PREFIX = ".rlhf-shared-folder-"

Reader = Callable[[str], Sequence[tuple[str, str | None]]]  # path -> (node, text) per rank


def read_marker(path: str) -> tuple[str, str | None]:
    """(this node's host name, the text of `path` as this process sees it, or None)."""
    try:
        return socket.gethostname(), Path(path).read_text()
    except OSError:
        return socket.gethostname(), None


def check_shared_folder(folder: str | Path, readers: dict[str, Reader]) -> None:
    """RLHFError naming the nodes (and the roles whose ranks run there) that cannot read a
    marker written into `folder`; `readers` maps a role to its ranks' `read_marker`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    marker = folder / f"{MARKER_PREFIX}{token}"
    marker.write_text(token)
    try:
        blind: dict[str, set[str]] = {}
        for role, reader in readers.items():
            for node, text in reader(str(marker)):
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
