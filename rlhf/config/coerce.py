"""Turn plain YAML values into typed config dataclasses, naming the dotted key on any error."""

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from rlhf.errors import ConfigError

_MISSING = dataclasses.MISSING
# Option values a release renamed, by field name: an old config is told what to write.
# recompute "selective" recomputed the whole attention block, not Megatron's core attention.
RENAMED_VALUES = {"recompute": {"selective": "attention_block"}}


def unwrap_optional(tp) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) of `X | None`; other types come back as is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        if len(args) != 1:
            raise TypeError(f"config fields support only `X | None` unions, got {tp}")
        return args[0], True
    return tp, False


def field_types(cls) -> dict[str, Any]:
    """Resolved annotations of a dataclass's fields, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(tp) -> str:
    """How a field type reads in messages and in the reference (YAML terms, not Python's)."""
    inner, optional = unwrap_optional(tp)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if origin is Literal:
        name = " | ".join(repr(a) for a in args)
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        name = f"list[{type_name(args[0])}]"
    elif origin is tuple:
        name = "[" + ", ".join(type_name(a) for a in args) + "]"
    elif dataclasses.is_dataclass(inner) or origin is dict:
        name = "mapping"
    else:
        name = inner.__name__
    return f"{name} | null" if optional else name


def dotted_keys(cls, prefix: str = "") -> Iterator[str]:
    """Every key below a dataclass, dotted (`parallel.tp`); list items read `functions[].path`."""
    for name, tp in field_types(cls).items():
        key = prefix + name
        yield key
        inner, _ = unwrap_optional(tp)
        if dataclasses.is_dataclass(inner):
            yield from dotted_keys(inner, key + ".")
        elif typing.get_origin(inner) is tuple:
            item = typing.get_args(inner)[0]
            if dataclasses.is_dataclass(item):
                yield from dotted_keys(item, key + "[].")


def _similarity(wrong: str, candidate: str) -> float:
    leaf = candidate.rsplit(".", 1)[-1]
    if wrong == leaf:  # right name, wrong level: `actor.tp` for `actor.parallel.tp`
        return 1.0
    initials = "".join(word[0] for word in wrong.split("_") if word)
    if len(initials) > 1 and initials == leaf:  # learning_rate -> lr
        return 0.9
    return max(difflib.SequenceMatcher(None, wrong, leaf).ratio(),
               difflib.SequenceMatcher(None, wrong, candidate).ratio())


def unknown_key_error(key: str, cls, parent: str) -> ConfigError:
    """`unknown key 'a.b'; did you mean 'a.c'?`, choosing among the keys below `cls`."""
    wrong = key.rsplit(".", 1)[-1]
    candidates = [c for c in dotted_keys(cls) if "[]" not in c]
    scored = [(_similarity(wrong, c), -c.count("."), c) for c in candidates]
    score, _, best = max(scored, default=(0.0, 0, ""))
    hint = f"; did you mean '{parent}{best}'?" if score >= 0.6 else ""
    valid = ", ".join(f.name for f in dataclasses.fields(cls))
    return ConfigError(f"unknown key '{key}'{hint} (valid keys under "
                       f"'{parent.rstrip('.') or 'the top level'}': {valid})")


def _type_error(key: str, tp, value, hint: str = "") -> ConfigError:
    got = "null" if value is None else f"{value!r} ({type(value).__name__})"
    return ConfigError(f"{key}: expected {type_name(tp)}, got {got}{hint}")


def _to_int(key: str, tp, value) -> int:
    if isinstance(value, bool):
        raise _type_error(key, tp, value)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise _type_error(key, tp, value)


def _to_float(key: str, tp, value) -> float:
    result = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value.strip())
        except ValueError:
            pass
    if result is None:
        raise _type_error(key, tp, value)
    if not math.isfinite(result):  # no config float means anything as nan or inf
        raise ConfigError(f"{key}: expected a finite float, got {value!r}")
    return result


def _to_bool(key: str, tp, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _type_error(key, tp, value, " (write true or false)")


def _to_tuple(key: str, tp, value) -> tuple:
    args = typing.get_args(tp)
    if args[1:] == (Ellipsis,) and args[0] is str and isinstance(value, str):
        return (value,)  # a single path or stop string needs no brackets
    if not isinstance(value, (list, tuple)):
        raise _type_error(key, tp, value, " (write a YAML list, e.g. [a, b])")
    if args[1:] == (Ellipsis,):
        return tuple(convert(item, args[0], f"{key}[{i}]") for i, item in enumerate(value))
    if len(value) != len(args):
        raise ConfigError(f"{key}: expected {len(args)} items {type_name(tp)}, got {list(value)!r}")
    return tuple(convert(item, arg, f"{key}[{i}]") for i, (item, arg) in
                 enumerate(zip(value, args)))


def convert(value, tp, key: str, base=None):
    """Check and coerce one YAML value to field type `tp`; `base` seeds a nested dataclass."""
    inner, optional = unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise _type_error(key, tp, value)
    origin = typing.get_origin(inner)
    if origin is Literal:
        if value not in typing.get_args(inner) or isinstance(value, bool):
            name = key.rsplit(".", 1)[-1]
            if value in RENAMED_VALUES.get(name, {}):
                new = RENAMED_VALUES[name][value]
                raise ConfigError(f"{key}: {value!r} was renamed {new!r}; write {name}: {new}")
            allowed = ", ".join(repr(a) for a in typing.get_args(inner))
            raise ConfigError(f"{key}: expected one of {allowed}; got {value!r}")
        return value
    if origin is tuple:
        return _to_tuple(key, inner, value)
    if dataclasses.is_dataclass(inner):
        return build(inner, value, key, base=base if isinstance(base, inner) else None)
    if origin is dict:  # free-form keyword arguments handed to user code, taken as written
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _type_error(key, tp, value, " (write a mapping with string keys)")
        return dict(value)
    if inner is bool:
        return _to_bool(key, tp, value)
    if inner is int:
        return _to_int(key, tp, value)
    if inner is float:
        return _to_float(key, tp, value)
    if inner is str:
        if not isinstance(value, str):
            raise _type_error(key, tp, value, " (quote it to make it a string)")
        return value
    raise TypeError(f"{key}: unsupported config field type {tp}")


def build(cls, value, key: str, *, base=None):
    """Build dataclass `cls` from a mapping; missing keys come from `base` or the defaults."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise _type_error(key, cls, value, f" (write a mapping of {cls.__name__} keys)")
    prefix = f"{key}." if key else ""
    types_by_name = field_types(cls)
    for name in value:
        if name not in types_by_name:
            raise unknown_key_error(f"{prefix}{name}", cls, prefix)
    kwargs = {}
    for f in dataclasses.fields(cls):
        current = getattr(base, f.name) if base is not None else _default(f)
        if f.name in value:
            kwargs[f.name] = convert(value[f.name], types_by_name[f.name], prefix + f.name,
                                     base=current)
        elif current is not _MISSING:
            kwargs[f.name] = current
        else:
            expected = type_name(types_by_name[f.name])
            raise ConfigError(f"missing key '{prefix}{f.name}' ({expected})")
    try:
        return cls(**kwargs)
    except ValueError as exc:  # ConfigError included: __post_init__ names bare fields
        raise ConfigError(qualify_message(str(exc), cls, prefix)) from None


def _default(f: dataclasses.Field):
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return _MISSING


def qualify_message(message: str, cls, prefix: str) -> str:
    """Rewrite bare field names of `cls` in a message as dotted keys (`lr` -> `actor.optim.lr`)."""
    if not prefix:
        return message
    names = sorted((f.name for f in dataclasses.fields(cls)), key=len, reverse=True)
    # Not after a dot, quote or word character, so values and dotted keys stay untouched.
    pattern = re.compile(r"(?<![\w.'\"])(" + "|".join(map(re.escape, names)) + r")(?![\w'\"])")
    qualified, count = pattern.subn(lambda m: prefix + m.group(1), message)
    return qualified if count else f"{prefix.rstrip('.')}: {message}"
