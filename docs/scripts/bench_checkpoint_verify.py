"""Time the resume-time check of a checkpoint: sizes + quick digests against every byte's sha256.

Writes a checkpoint of GB gigabytes (FILES random files under actor/, like one rank's data
file each, through CheckpointManager.save, which records both digests), then times
`verify_checkpoint` both ways, each from a cold page cache for those files (posix_fadvise
DONTNEED) and again warm. Usage: PYTHONPATH=. python docs/scripts/bench_checkpoint_verify.py
[GB] [FILES] [FOLDER].
"""

import os
import sys
import tempfile
import time
from pathlib import Path

from rlhf.trainer.checkpoint import CheckpointManager, verify_checkpoint


def _evict(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    files = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    root = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp())
    per_file = int(gb * 2**30 / files)
    block = os.urandom(1 << 24)

    def write_roles(folder: Path) -> None:
        (folder / "actor").mkdir()
        for i in range(files):
            with open(folder / "actor" / f"__{i}_0.distcp", "wb") as f:
                for _ in range(per_file // len(block)):
                    f.write(block)

    start = time.perf_counter()
    folder = CheckpointManager(root).save(1, write_roles=write_roles, state={"step": 1})
    print(f"save of {gb:g} GB in {files} files, manifest included: "
          f"{time.perf_counter() - start:.1f} s")
    for cache in ("cold", "warm"):
        for full in (True, False):
            if cache == "cold":
                _evict(folder)
            start = time.perf_counter()
            assert verify_checkpoint(folder, full_hash=full) is None
            print(f"verify {'full sha256' if full else 'quick'} ({cache} cache): "
                  f"{time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
