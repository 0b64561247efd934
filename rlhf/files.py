"""Writing files and folders so that a crash never leaves a half-written one behind."""

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


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
