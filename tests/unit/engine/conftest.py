"""Fixtures of the engine tests: a tiny model folder and a one-process gloo world."""

import sys
from pathlib import Path

import pytest

# `reference.py` is imported as tests.unit.engine.reference (also by tests/dist/test_engine.py).
_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.unit.engine.reference import GlooWorld, tiny_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def world():
    with GlooWorld():
        yield
