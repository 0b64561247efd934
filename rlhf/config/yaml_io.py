"""YAML reading and writing with YAML 1.2-style scalars.

PyYAML follows YAML 1.1, where `yes`/`on` are booleans, `1e-5` is a string, `017` is octal
and `2024-01-01` is a date. Configs use the 1.2 rules instead: only true/false are booleans,
1e-5 is a float, integers are decimal, and everything else stays a string. Duplicate keys
are an error rather than "last one wins".
"""

import re
from pathlib import Path
from typing import Any

import yaml

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
