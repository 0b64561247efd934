"""Files and folders: written so that a crash never leaves a half-written one behind, and
checked to be seen by every node before workers write into them."""

import logging
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from rlhf.errors import RLHFError

logger = logging.getLogger(__name__)


@contextmanager
def atomic_write(path: str | Path, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Write through a sibling temp file that is synced and renamed over `path` on success and
    removed on failure: readers see the old file or the complete new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A sibling keeps the rename on one file system; a named "x"-mode file rather than mkstemp
    # keeps the usual umask permissions.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, mode.replace("w", "x"), **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Fill a sibling temp folder (yielded) that replaces `path` as a whole on success and is
    removed on failure: readers see the old folder or the complete new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        _swap_in(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(new: Path, path: Path) -> None:
    if not path.exists():
        os.replace(new, path)
        return
    old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        os.replace(old, path)  # put the previous folder back
        raise
    shutil.rmtree(old, ignore_errors=True)


# ---- a folder every node sees ----------------------------------------------------------------
# Checkpoints and exports are written by the workers on their own nodes into a folder the driver
# created. When that folder is not on a file system every node mounts, each node would write its
# shards into a local folder of the same name and the checkpoint would never be whole. The
# driver writes a marker file with a fresh token; every rank reads it back (`read_marker`, a
# worker method) and the job stops at once, naming the nodes that do not see it.

MARKER_PREFIX = ".rlhf-shared-folder-"

MarkerReader = Callable[[str], Sequence[tuple[str, str | None]]]  # path -> (node, text) per rank


def read_marker(path: str, *, node: str | None = None) -> tuple[str, str | None]:
    """(`node`, default this host's name, the text of `path` as this process sees it, or
    None)."""
    node = node or socket.gethostname()
    try:
        return node, Path(path).read_text()
    except OSError:
        return node, None


def check_shared_folder(folder: str | Path, readers: dict[str, MarkerReader]) -> None:
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
