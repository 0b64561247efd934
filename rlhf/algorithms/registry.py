"""Name -> function tables behind `register_advantage`, `register_kl`, `register_policy_loss`,
`register_group_filter` and `register_loss_agg`, and the one lookup they share.

The tables hold functions only (filled once at import), never run-time state. A config value
with a ':' names a user function instead ('package.module:function' or
'path/to/file.py:function', as reward functions are named); it is loaded once per process.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from typing import TypeVar

from rlhf.errors import RLHFError
from rlhf.rewards.loader import load_object

F = TypeVar("F", bound=Callable)


def register(table: dict[str, Callable], kind: str, name: str) -> Callable[[F], F]:
    """A decorator that adds a function to `table` under `name`; a name can be taken once."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a {kind} name must be a non-empty string without ':', got {name!r}")

    def add(fn: F) -> F:
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered (by {table[name].__name__})")
        table[name] = fn
        return fn

    return add


def is_user_spec(name: str) -> bool:
    """Whether a config value names a user function ('module:function', 'file.py:function')
    rather than a registered name."""
    return isinstance(name, str) and ":" in name


def lookup(table: dict[str, Callable], kind: str, name: str) -> Callable:
    """The function registered under `name`, or the user function it names; a ValueError
    with the closest registered name and every registered one otherwise."""
    if is_user_spec(name):
        return _load_user_function(name, kind)
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(unknown_name(table, kind, name)) from None


def unknown_name(table: dict[str, Callable], kind: str, name: object) -> str:
    """The message for a name no entry of `table` has: a guess, the choices, the user form."""
    known = sorted(table)
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"unknown {kind} {name!r}{guess}; registered: {', '.join(known) or 'none'}; or "
            f"name your own as 'package.module:function' or 'path/to/file.py:function'")


@functools.cache
def _load_user_function(spec: str, kind: str) -> Callable:
    try:
        fn = load_object(spec, what=kind)
    except RLHFError as e:
        raise ValueError(str(e)) from None
    if not callable(fn):
        raise ValueError(f"{kind} {spec!r}: {spec.rpartition(':')[2]} is a "
                         f"{type(fn).__name__}, not a function")
    return fn
