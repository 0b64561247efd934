"""A Markdown reference of every config key, generated from the dataclasses and their docstrings."""

import ast
import dataclasses
import inspect
import textwrap
import typing

from rlhf.config.loader import field_types, type_name, unwrap_optional
from rlhf.config.schema import JobConfig

_INTRO = """\
Generated from the dataclasses in `rlhf/config/` by `rlhf config docs`; do not edit by hand.
Set keys in a YAML file (`actor: {optim: {lr: 1.0e-6}}`) or as command-line overrides
(`rlhf config show configs/quickstart.yaml actor.optim.lr=1e-6`). Unknown keys are errors.
Relative paths are relative to the working directory, except `base:` (a file this config
extends), which is relative to the config file. A job must set `data.train_files` and a reward
(`reward.functions` or `reward.model_path`).
"""


def field_docs(cls) -> dict[str, str]:
    """The attribute docstring of every field of dataclass `cls`, inherited ones included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # subclasses last, so their docstrings win
        if not dataclasses.is_dataclass(klass):
            continue
        node = ast.parse(textwrap.dedent(inspect.getsource(typing.cast(type, klass)))).body[0]
        assert isinstance(node, ast.ClassDef)
        body = node.body
        for stmt, after in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _inline(value) -> str:
    """A default as it would be written in YAML flow style."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '""' if not value else value
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_inline(item) for item in value) + "]"
    if dataclasses.is_dataclass(value):
        return "{...}"
    return repr(value)


def _cell(text: str, code: bool = False) -> str:
    text = text.replace("|", "\\|")
    return f"`{text}`" if code else text


def _rows(cls, instance, prefix: str) -> list[str]:
    """Table rows of every field below `cls`; defaults are read from `instance` when given."""
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        key = prefix + f.name
        if instance is not None:
            default = _inline(getattr(instance, f.name))
        elif f.default is not dataclasses.MISSING:
            default = _inline(f.default)
        else:
            default = "required"
        inner, optional = unwrap_optional(tp)
        args = typing.get_args(inner)
        if dataclasses.is_dataclass(inner):
            value = getattr(instance, f.name) if instance is not None else None
            if optional:  # a row for the switch itself, then the keys inside it
                rows.append(_row(key, tp, default, docs[f.name]))
            rows += _rows(inner, value if value is not None else typing.cast(type, inner)(),
                          key + ".")
            continue
        rows.append(_row(key, tp, default, docs[f.name]))
        if typing.get_origin(inner) is tuple and args and dataclasses.is_dataclass(args[0]):
            rows += _rows(args[0], None, key + "[].")
    return rows


def _row(key: str, tp, default: str, doc: str) -> str:
    code_default = _cell(default, code=default != "required")
    return f"| {_cell(key, True)} | {_cell(type_name(tp), True)} | {code_default} | {_cell(doc)} |"


def reference_markdown() -> str:
    """The configuration reference: a table per JobConfig section (key, type, default, meaning)."""
    defaults = JobConfig()
    docs = field_docs(JobConfig)
    parts = ["### Configuration reference\n", _INTRO]
    for f in dataclasses.fields(JobConfig):
        section_cls = field_types(JobConfig)[f.name]
        parts.append(f"#### `{f.name}`\n")
        parts.append(docs[f.name] + "\n")
        parts.append("| Key | Type | Default | Meaning |\n|---|---|---|---|")
        parts.append("\n".join(_rows(section_cls, getattr(defaults, f.name), f.name + ".")) + "\n")
    return "\n".join(parts)
