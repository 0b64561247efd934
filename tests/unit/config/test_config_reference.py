"""The Markdown reference is generated from the dataclasses and covers every key."""

import dataclasses
import re

from rlhf.config import JobConfig, reference_markdown
from rlhf.config.loader import dotted_keys, field_types, unwrap_optional
from rlhf.config.reference import field_docs


def _config_classes(cls, seen=None):
    """Every dataclass reachable from `cls` through its fields."""
    seen = seen if seen is not None else []
    if cls not in seen:
        seen.append(cls)
        for tp in field_types(cls).values():
            inner = unwrap_optional(tp)[0]
            for candidate in (inner, *getattr(inner, "__args__", ())):
                if dataclasses.is_dataclass(candidate):
                    _config_classes(candidate, seen)
    return seen


def test_every_field_has_a_docstring():
    classes = _config_classes(JobConfig)
    assert len(classes) >= 14
    for cls in classes:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_reference_lists_every_key_once():
    text = reference_markdown()
    rows = re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)
    expected = [key for key in dotted_keys(JobConfig)
                if not dataclasses.is_dataclass(_type_of(key)) or key in ("model.tiny",)]
    assert sorted(rows) == sorted(expected)
    assert len(rows) == len(set(rows))
    for section in (f.name for f in dataclasses.fields(JobConfig)):
        assert f"\n#### `{section}`\n" in text


def _type_of(key: str):
    """The field type behind a dotted key (`[]` steps into list items)."""
    cls, tp = JobConfig, None
    for part in key.replace("[]", "").split("."):
        tp = field_types(cls)[part]
        inner = unwrap_optional(tp)[0]
        args = getattr(inner, "__args__", ())
        cls = args[0] if args and dataclasses.is_dataclass(args[0]) else inner
    return unwrap_optional(tp)[0]


def test_reference_shows_types_defaults_and_docs():
    text = reference_markdown()
    assert "| `critic.optim.lr` | `float` | `1e-05` | Peak learning rate. |" in text
    assert "| `actor.optim.lr` | `float` | `1e-06` |" in text
    assert "| `model.tiny` | `mapping \\| null` | `null` |" in text
    assert "| `model.tiny.num_heads` | `int` | `4` |" in text
    assert "| `reward.functions[].path` | `str` | required |" in text
    assert "`'constant' \\| 'linear' \\| 'cosine'`" in text
    for line in text.splitlines():
        if line.startswith("| `"):
            assert len(re.findall(r"(?<!\\)\|", line)) == 5, line


def test_reference_is_deterministic():
    assert reference_markdown() == reference_markdown()
