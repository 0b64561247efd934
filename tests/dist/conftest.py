"""Shared setup for the multi-process tests (gloo on CPU, started by rlhf.parallel.launch)."""

import sys
from pathlib import Path

# Spawned ranks unpickle the test's worker functions by module name ("tests.dist.test_mesh"),
# so the repository root must be importable in them; the fork server they start from
# (tests/conftest.py) takes this sys.path when the session's first launch starts it.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
