"""Name -> function tables behind `register_advantage`, `register_kl` and `register_loss_agg`.

The tables hold functions only (filled once at import), never run-time state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def register(table: dict[str, Callable], kind: str, name: str) -> Callable[[F], F]:
    """A decorator that adds a function to `table` under `name`; a name can be taken once."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {kind} name must be a non-empty string, got {name!r}")

    def add(fn: F) -> F:
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered (by {table[name].__name__})")
        table[name] = fn
        return fn

    return add


def lookup(table: dict[str, Callable], kind: str, name: str) -> Callable:
    """The function registered under `name`, or a ValueError listing the registered names."""
    try:
        return table[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(table)) or "none"
        raise ValueError(f"unknown {kind} {name!r}; registered: {known}") from None
