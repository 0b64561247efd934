"""Benchmarks behind `rlhf bench NAME`: each prints JSON lines of measured figures."""

from __future__ import annotations

import json


def print_checked(lines: list[dict]) -> int:
    """Print each line as JSON; the exit status is 1 when a line says `passed: false`."""
    for line in lines:
        print(json.dumps(line), flush=True)
    return 0 if all(line.get("passed", True) for line in lines) else 1
