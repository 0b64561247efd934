"""A JSON Schema of config files for editors (`rlhf config schema`): completion, hover docs and
red squiggles for unknown keys and wrong types in VS Code and other YAML language servers.

pydantic writes it from the same validator the loader uses, so it accepts what the loader
accepts; cross-section rules and `__post_init__` range checks are left to `rlhf config show`.
"""

from rlhf.config.loader import BASE_KEY, type_adapter
from rlhf.config.reference import field_docs
from rlhf.config.schema import JobConfig

# Draft 7, the newest the YAML language server (VS Code's YAML extension) fully supports.
DRAFT = "http://json-schema.org/draft-07/schema#"


def config_json_schema() -> dict:
    """The JSON Schema (draft 7) of one YAML config file, before `base:` is merged in."""
    from pydantic.json_schema import GenerateJsonSchema

    class EditorSchema(GenerateJsonSchema):
        def dataclass_schema(self, schema):
            # The field docstrings as hover text, read as the Markdown reference reads them.
            json_schema = super().dataclass_schema(schema)
            for name, doc in field_docs(schema["cls"]).items():
                json_schema["properties"][name]["description"] = doc
            return json_schema

        def tuple_schema(self, schema):
            # The loader takes one string where a list of strings is expected (`stop: </s>`).
            json_schema = super().tuple_schema(schema)
            if "prefixItems" in json_schema:  # [float, float]: draft 7 writes it as `items`
                json_schema["items"] = json_schema.pop("prefixItems")
            if schema.get("variadic_item_index") == 0 and \
                    [item["type"] for item in schema["items_schema"]] == ["str"]:
                return {"anyOf": [json_schema, {"type": "string"}]}
            return json_schema

    wrapped = type_adapter(JobConfig).json_schema(schema_generator=EditorSchema,
                                                  ref_template="#/definitions/{model}")
    defs = wrapped["$defs"]
    root = defs.pop(JobConfig.__name__)  # the loader's adapter wraps JobConfig in a 1-tuple
    base = {"type": "string", "description": "A config file this one extends (relative to this "
            "file); its keys are merged underneath, mapping by mapping."}
    return {"$schema": DRAFT, **root, "title": "rlhf job config",
            "properties": {BASE_KEY: base, **root["properties"]}, "definitions": defs}
