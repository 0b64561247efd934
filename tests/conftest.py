"""Shared by every tier: no test may reach a model hub (none is reachable here anyway)."""

import pytest


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
