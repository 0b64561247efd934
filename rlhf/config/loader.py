"""Load a JobConfig from YAML files and `section.key=value` overrides, and write it back.

Plain YAML values become typed dataclasses through pydantic (strict types, unknown keys
refused), each of its errors turned into one line naming the dotted key. YAML is read
with 1.2-style scalars: PyYAML follows YAML 1.1, where `yes`/`on` are booleans, `1e-5` is a
string, `017` is octal and `2024-01-01` is a date; configs use the 1.2 rules instead (only
true/false are booleans, 1e-5 is a float, integers are decimal, everything else stays a
string), and duplicate keys are an error rather than "last one wins".
"""

import dataclasses
import difflib
import functools
import json
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from rlhf.config.checks import check_config
from rlhf.config.schema import JobConfig
from rlhf.errors import ConfigError

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"

_RAW_LINE_BREAKS = "\x85\u2028\u2029"
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT_RE = re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$")
_FLOAT_RE = re.compile(r"""^(?:[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?
                           |[-+]?\.(?:inf|Inf|INF)
                           |\.(?:nan|NaN|NAN))$""", re.X)


def _yaml12_resolvers() -> dict:
    """PyYAML's implicit resolvers minus the YAML 1.1 bool/int/float/timestamp ones."""
    replaced = (_BOOL, _INT, _FLOAT, _TIMESTAMP)
    return {first: [(tag, regexp) for tag, regexp in entries if tag not in replaced]
            for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()}


class _Loader(yaml.SafeLoader):
    yaml_implicit_resolvers = _yaml12_resolvers()

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark)
            if isinstance(key, str):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    # Same resolvers as the loader, so a string like "1e-5" or "017" gets quoted on output.
    yaml_implicit_resolvers = _yaml12_resolvers()

    def represent_list(self, data):
        # Lists of scalars read best inline ([0.9, 0.999]); lists of mappings as blocks.
        inline = all(not isinstance(item, (dict, list)) for item in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=inline)


_Dumper.add_representer(list, _Dumper.represent_list)
for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(_BOOL, _BOOL_RE, list("tTfF"))
    _cls.add_implicit_resolver(_INT, _INT_RE, list("-+0123456789"))
    _cls.add_implicit_resolver(_FLOAT, _FLOAT_RE, list("-+0123456789."))


def parse_yaml(text: str) -> Any:
    """Parse YAML text with the config scalar rules; raises yaml.YAMLError."""
    return yaml.load(text, Loader=_Loader)


def dump_yaml(data: Any) -> str:
    """Block-style YAML whose lists of scalars are written inline; key order is kept."""
    text = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True, width=100)
    if any(char in text for char in _RAW_LINE_BREAKS):
        # PyYAML writes these raw but reads them back as line breaks; escape all non-ASCII.
        text = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                         allow_unicode=False, width=100)
    return text


def read_yaml_mapping(path: Path) -> dict:
    """Read a YAML file that must hold a mapping; errors name the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections "
                          f"(model:, actor:, ...), got a {type(data).__name__}")
    return data


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


# pydantic checks the types. YAML values are JSON values, and pydantic's strict JSON mode types
# them the way a config should: ints only from integers, floats from integers too, booleans
# only from true/false, lists for tuples, no string ever read as a number. A stdlib dataclass
# takes pydantic settings only from an enclosing type, so a one-item tuple carries them.
# (pydantic is imported where it is used: `rlhf --help` loads this module and stays instant.)
_PYDANTIC = {"strict": True, "extra": "forbid", "allow_inf_nan": False}


@functools.cache
def type_adapter(cls):
    """The pydantic TypeAdapter of dataclass `cls` (wrapped in a one-item tuple, see above)."""
    import pydantic

    # a type built at run time from `cls`, which a static checker cannot read as one
    return pydantic.TypeAdapter(tuple[cls],  # pyright: ignore[reportInvalidTypeForm]
                                config=pydantic.ConfigDict(**_PYDANTIC))


def build(cls, value, key: str = "", *, base=None):
    """Build dataclass `cls` from a mapping; missing keys come from `base` or the defaults.

    `key` is where the mapping sits in the config (`actor.optim`); errors name dotted keys."""
    import pydantic

    if isinstance(value, cls):
        return value
    tree = _json_tree(value, cls, key)
    if base is not None and isinstance(tree, dict):
        # `base` rather than the class defaults under every key: critic.optim's own lr stays.
        tree = merge_trees(typing.cast(dict, _json_tree(config_to_dict(base), cls, key)), tree)
    try:
        return type_adapter(cls).validate_json(json.dumps([tree]))[0]
    except pydantic.ValidationError as exc:
        lines = [_error_line(error, cls, key) for error in exc.errors(include_url=False)]
        raise ConfigError("\n".join(dict.fromkeys(lines))) from None


def _json_tree(value, tp, key: str):
    """A YAML value (at `key`, of field type `tp`) as JSON values; a single string where a list
    of strings is expected becomes a one-item list (`stop: </s>`, `train_files: a.jsonl`)."""
    inner = unwrap_optional(tp)[0]
    args: tuple[Any, ...] = typing.get_args(inner) if typing.get_origin(inner) is tuple else ()
    if isinstance(value, Mapping):
        fields = field_types(inner) if dataclasses.is_dataclass(inner) else {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise ConfigError(f"{key or 'the config'}: keys must be strings, got {name!r}")
            new = RENAMED_VALUES.get(name, {}).get(item) if isinstance(item, str) else None
            if name in fields and new is not None:
                raise ConfigError(f"{_join(key, name)}: {item!r} was renamed {new!r}; write "
                                  f"{name}: {new}")
        return {name: _json_tree(item, fields.get(name), _join(key, name))
                for name, item in value.items()}
    if isinstance(value, str) and args == (str, Ellipsis):
        return [value]
    if isinstance(value, (list, tuple)):
        items = [args[0]] * len(value) if args[1:] == (Ellipsis,) else args
        return [_json_tree(item, items[i] if i < len(items) else None, f"{key}[{i}]")
                for i, item in enumerate(value)]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ConfigError(f"{key}: {value!r} ({type(value).__name__}) is not a YAML number, string, "
                      "boolean, list or mapping")


def _join(key: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{key}[{part}]"
    return f"{key}.{part}" if key else part


def _prefix(key: str) -> str:
    return key + "." if key else ""


def _type_at(cls, loc: tuple) -> Any:
    """The declared type at a pydantic error location below dataclass `cls` (None if unknown)."""
    tp = cls
    for part in loc:
        inner = unwrap_optional(tp)[0]
        if isinstance(part, str) and dataclasses.is_dataclass(inner):
            tp = field_types(inner).get(part)
        elif isinstance(part, int) and typing.get_origin(inner) is tuple:
            args = typing.get_args(inner)
            tp = args[0] if args[1:] == (Ellipsis,) else args[part] if part < len(args) else None
        else:
            return None
    return tp


# What to write instead, by the kind of value a key expected.
_HINTS = {bool: " (write true or false)", str: " (quote it to make it a string)",
          tuple: " (write a YAML list, e.g. [a, b])", dict: " (write a mapping with string keys)"}


def _error_line(error: Mapping[str, Any], cls, key: str) -> str:
    """One pydantic error as one line of ours: the dotted key, the value, what is expected."""
    loc = error["loc"][1:]  # past the wrapping tuple's index
    where = functools.reduce(_join, loc, key)
    kind, value = error["type"], error["input"]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        parent = functools.reduce(_join, loc[:-1], key)
        return str(unknown_key_error(where, _type_at(cls, loc[:-1]), _prefix(parent)))
    if kind == "value_error":  # __post_init__ names bare fields; make them dotted keys
        owner = unwrap_optional(_type_at(cls, loc))[0]
        return qualify_message(str(error["ctx"]["error"]), owner, _prefix(where))
    if kind == "missing" and loc and isinstance(loc[-1], int):  # a fixed-length list too short
        where = functools.reduce(_join, loc[:-1], key)
        return f"{where}: expected {type_name(_type_at(cls, loc[:-1]))}, got {value!r}"
    tp = _type_at(cls, loc)
    if kind == "missing":
        return f"missing key '{where}' ({type_name(tp)})"
    if kind == "literal_error":
        allowed = ", ".join(repr(a) for a in typing.get_args(unwrap_optional(tp)[0]))
        return f"{where}: expected one of {allowed}; got {value!r}"
    if kind == "finite_number":  # no config float means anything as nan or inf
        return f"{where}: expected a finite float, got {value!r}"
    got = "null" if value is None else f"{value!r} ({type(value).__name__})"
    if tp is None:
        return f"{where}: {error['msg']}, got {got}"
    inner = unwrap_optional(tp)[0]
    origin = typing.get_origin(inner) or inner
    hint = (f" (write a mapping of {typing.cast(type, inner).__name__} keys)"
            if dataclasses.is_dataclass(inner)
            else "" if origin is tuple and isinstance(value, list) else _HINTS.get(origin, ""))
    return f"{where}: expected {type_name(tp)}, got {got}{hint}"


def qualify_message(message: str, cls, prefix: str) -> str:
    """Rewrite bare field names of `cls` in a message as dotted keys (`lr` -> `actor.optim.lr`)."""
    if not prefix:
        return message
    names = sorted((f.name for f in dataclasses.fields(cls)), key=len, reverse=True)
    # Not after a dot, quote or word character, so values and dotted keys stay untouched.
    pattern = re.compile(r"(?<![\w.'\"])(" + "|".join(map(re.escape, names)) + r")(?![\w'\"])")
    qualified, count = pattern.subn(lambda m: prefix + m.group(1), message)
    return qualified if count else f"{prefix.rstrip('.')}: {message}"


BASE_KEY = "base"


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a YAML config (or start from defaults when `path` is None), apply overrides, check.

    Raises ConfigError naming the dotted key(s) of what is wrong and how to fix it.
    """
    tree = read_config_tree(Path(path)) if path is not None else {}
    for override in overrides:
        apply_override(tree, override)
    return config_from_dict(tree)


def config_from_dict(data: Mapping) -> JobConfig:
    """Build and check a JobConfig from a nested mapping shaped like the YAML files."""
    cfg = build(JobConfig, data, base=JobConfig())
    check_config(cfg)
    return cfg


def read_config_tree(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """A config file as a nested dict, with its `base:` file (if any) merged underneath."""
    resolved = path.resolve()
    if resolved in _chain:
        loop = " -> ".join(str(p) for p in (*_chain, resolved))
        raise ConfigError(f"config files inherit from each other in a loop: {loop}")
    tree = read_yaml_mapping(path)
    if BASE_KEY not in tree:
        return tree
    base = tree.pop(BASE_KEY)
    if not isinstance(base, str) or not base:
        raise ConfigError(f"config file {str(path)!r}: '{BASE_KEY}' must be a file name "
                          f"(relative to this file), got {base!r}")
    base_path = path.parent / base
    if not base_path.is_file():
        raise ConfigError(f"config file {str(path)!r}: its base {str(base_path)!r} does not exist")
    return merge_trees(read_config_tree(base_path, (*_chain, resolved)), tree)


def merge_trees(base: dict, top: Mapping) -> dict:
    """Values of `top` over `base`; mappings merge key by key, anything else replaces."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_trees(merged[key], value)
        else:
            merged[key] = value
    return merged


def apply_override(tree: dict, override: str) -> None:
    """Set one `section.key=value` override (value parsed as YAML) into a config tree."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r} must look like section.key=value, "
                          f"e.g. actor.optim.lr=1e-6")
    parts = key.split(".")
    leaf_type = _override_type(parts, override)
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {override!r}: the value is not valid YAML: {exc}") from None
    if unwrap_optional(leaf_type)[0] is str and isinstance(value, (bool, int, float)):
        value = raw.strip()  # `experiment_name=2024` means the string, as the user typed it
    node = tree
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
        value = merge_trees(node[parts[-1]], value)  # same rule as `base:`: mappings merge
    node[parts[-1]] = value


def _override_type(parts: list[str], override: str):
    """The field type an override's key leads to; unknown keys fail here, naming the override."""
    cls, tp = JobConfig, None
    for depth, part in enumerate(parts):
        if cls is None:
            parent = ".".join(parts[:depth])
            raise ConfigError(f"override {override!r}: '{parent}' has no sub-keys; set it whole, "
                              f"e.g. {parent}=[...]")
        types_by_name = field_types(cls)
        if part not in types_by_name:
            prefix = "".join(p + "." for p in parts[:depth])
            raise ConfigError(f"{unknown_key_error(prefix + part, cls, prefix)} "
                              f"in override {override!r}")
        tp = types_by_name[part]
        inner = unwrap_optional(tp)[0]
        cls = inner if dataclasses.is_dataclass(inner) else None
    return tp


def config_to_dict(cfg) -> dict:
    """A config dataclass as plain nested dicts and lists (field order kept), for YAML/JSON."""
    return typing.cast(dict, _plain(cfg))


def _plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value


def format_config(cfg: JobConfig) -> str:
    """The fully resolved config as YAML; loading that text gives back an equal JobConfig."""
    return dump_yaml(config_to_dict(cfg))


__all__ = ["load_config", "config_from_dict", "config_to_dict", "format_config",
           "apply_override", "merge_trees", "read_config_tree"]


def add_job_arguments(parser, *, example: str) -> None:
    """The positional `config` and `overrides` every job command takes (`example`: an override
    line shown in the help)."""
    parser.add_argument("config", help="YAML file, e.g. configs/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help=f"overrides, e.g. {example}")
