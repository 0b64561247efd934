"""Load a JobConfig from YAML files and `section.key=value` overrides, and write it back."""

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from rlhf.config.checks import check_config
from rlhf.config.coerce import build, field_types, unknown_key_error, unwrap_optional
from rlhf.config.schema import JobConfig
from rlhf.config.yaml_io import dump_yaml, parse_yaml, read_yaml_mapping
from rlhf.errors import ConfigError

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
    cfg = build(JobConfig, data, "")
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
    return _plain(cfg)


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
