"""Environment variables set for a while: around the start of a process that inherits them
(a local Ray cluster's raylet, a vLLM engine), then put back as they were."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def scoped_environ(settings: Mapping[str, str]) -> Iterator[None]:
    """`settings` in os.environ within; afterwards each key restored (removed if it was unset)."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
