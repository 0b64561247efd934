"""The editor schema (`rlhf config schema`): valid JSON Schema, every key described, every
shipped config valid under it, and the loader's verdict on the types it checks."""

import dataclasses
import json
import typing
from pathlib import Path

import jsonschema
import pytest

from rlhf.cli import main
from rlhf.config import ConfigError, JobConfig, load_config
from rlhf.config.json_schema import config_json_schema
from rlhf.config.loader import (
    dotted_keys,
    field_types,
    parse_yaml,
    read_yaml_mapping,
    unwrap_optional,
)
from rlhf.config.reference import field_docs

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").rglob("*.yaml"))
QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


@pytest.fixture(scope="module")
def schema():
    return config_json_schema()


@pytest.fixture(scope="module")
def validator(schema):
    return jsonschema.Draft7Validator(schema)


def test_the_schema_is_valid_draft_7(schema):
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    json.dumps(schema)  # plain JSON, as an editor reads it


def _object(schema: dict, node: dict) -> dict:
    """The object schema behind a property: through `$ref` and past the `null` of `X | null`."""
    if "$ref" in node:
        assert node["$ref"].startswith("#/definitions/")
        return _object(schema, schema["definitions"][node["$ref"].rsplit("/", 1)[-1]])
    if "anyOf" in node:
        return _object(schema, next(b for b in node["anyOf"] if b.get("type") != "null"))
    return node


def _described_keys(schema: dict, cls, node: dict, prefix: str = "") -> list[str]:
    """Dotted keys of `cls` found in `node`, asserting each carries the field's docstring."""
    docs, found = field_docs(cls), []
    for name, tp in field_types(cls).items():
        key, prop = prefix + name, node["properties"][name]
        assert prop["description"] == docs[name], key
        found.append(key)
        inner = unwrap_optional(tp)[0]
        args = typing.get_args(inner)
        if dataclasses.is_dataclass(inner):
            found += _described_keys(schema, inner, _object(schema, prop), key + ".")
        elif args and dataclasses.is_dataclass(args[0]):
            items = _object(schema, _object(schema, prop)["items"])
            found += _described_keys(schema, args[0], items, key + "[].")
    assert node["additionalProperties"] is False, prefix
    return found


def test_every_key_is_named_with_its_docstring(schema):
    assert sorted(_described_keys(schema, JobConfig, schema)) == sorted(dotted_keys(JobConfig))
    assert set(schema["properties"]) == {"base"} | {f.name for f in dataclasses.fields(JobConfig)}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_is_valid(validator, path):
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}"
              for e in validator.iter_errors(read_yaml_mapping(path))]
    assert not errors


# The loader and the schema agree on keys and types (range rules are the loader's alone).
VERDICTS = {
    "int": ("actor.parallel.tp=2", True),
    "float-from-int": ("actor.optim.lr=1", True),
    "one-string-for-a-list": ("rollout.stop=</s>", True),
    "null-for-optional": ("rollout.tis_cap=null", True),
    "list-of-mappings": ("reward.functions=[{path: 'a.b:c', weight: 2}]", True),
    "int-from-string": ("actor.parallel.tp='2'", False),
    "float-from-string": ("actor.optim.lr='1e-5'", False),
    "bool-from-yes": ("trainer.ray_metrics=yes", False),
    "literal": ("actor.optim.schedule=cos", False),
    "null-for-required": ("rollout.n=null", False),
    "list-length": ("actor.optim.betas=[0.9]", False),
    "list-too-long": ("actor.optim.betas=[0.9, 0.9, 0.9]", False),
    "list-item-type": ("rollout.reject_band=[0.5, x]", False),
    "mapping": ("actor.optim=3", False),
    "unknown-in-list-item": ("reward.functions=[{path: 'a.b:c', wieght: 2}]", False),
}


@pytest.mark.parametrize("override, valid", VERDICTS.values(), ids=VERDICTS.keys())
def test_schema_and_loader_agree(validator, override, valid):
    key, _, value = override.partition("=")
    *parents, leaf = key.split(".")
    tree = node = {}
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = parse_yaml(value)
    assert validator.is_valid(tree) is valid
    if valid:
        load_config(QUICKSTART, [override])
    else:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(QUICKSTART, [override])


def test_unknown_top_level_key_is_invalid(validator):
    assert not validator.is_valid({"trainer": {}, "algoritm": {}})
    assert validator.is_valid({"base": "quickstart.yaml", "trainer": {"total_steps": 3}})


def test_cli_prints_and_writes_the_schema(capsys, tmp_path, schema):
    assert main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == schema
    out = tmp_path / ".vscode" / "rlhf-config.schema.json"
    assert main(["config", "schema", str(out)]) == 0
    assert json.loads(out.read_text()) == schema and str(out) in capsys.readouterr().out
