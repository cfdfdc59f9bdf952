"""The JSON schema of the dashboard's snapshot, generated from its types (snapshot.py), so
that what `/api/schema` says and what `/api/snapshot` sends cannot drift apart.

A small generator over `typing.get_type_hints`, enough for the types a snapshot is made of:
TypedDicts (an object with fixed keys, each a definition of its own under `$defs`, its
docstring as description; `NotRequired` keys left out of `required`), `dict[str, X]` (an
object whose keys are data: URLs, model names, codes), lists, unions, Literals, and JSON's
scalars. Anything else is a bug in a snapshot type and raises TypeError.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Literal, NotRequired, Required, Union, cast

from app.dashboard.snapshot import Snapshot

JsonSchema = dict[str, object]

SCALARS: dict[object, JsonSchema] = {
    bool: {"type": "boolean"},
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    type(None): {"type": "null"},
}


def json_schema(root: type) -> JsonSchema:
    """The schema (draft 2020-12) of `root`, a TypedDict, with every TypedDict it holds
    under `$defs`."""
    definitions: dict[str, JsonSchema] = {}
    top = _schema_of(root, definitions)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"Sluice dashboard: {root.__name__}",
        **top,
        "$defs": dict(sorted(definitions.items())),
    }


def _schema_of(hint: object, definitions: dict[str, JsonSchema]) -> JsonSchema:
    if hint in SCALARS:
        return dict(SCALARS[hint])
    if typing.is_typeddict(hint):
        assert isinstance(hint, type)
        _define(hint, definitions)
        return {"$ref": f"#/$defs/{hint.__name__}"}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return {"anyOf": [_schema_of(arg, definitions) for arg in args]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin is list:
        return {"type": "array", "items": _schema_of(args[0], definitions)}
    if origin is dict and args[0] is str:
        return {"type": "object", "additionalProperties": _schema_of(args[1], definitions)}
    raise TypeError(f"no JSON schema for {hint!r}")


def _define(typed_dict: type, definitions: dict[str, JsonSchema]) -> None:
    name = typed_dict.__name__
    if name in definitions:
        return
    definitions[name] = {}  # a placeholder: a type that holds itself stops here
    properties: dict[str, JsonSchema] = {}
    required: list[str] = []
    # `__required_keys__` cannot tell NotRequired in a string annotation (Python 3.11):
    # the hints, with their qualifiers kept, can.
    for key, hint in typing.get_type_hints(typed_dict, include_extras=True).items():
        qualifier = typing.get_origin(hint)
        if qualifier in (NotRequired, Required):
            (hint,) = typing.get_args(hint)
        if qualifier is not NotRequired:
            required.append(key)
        properties[key] = _schema_of(hint, definitions)
    definition: JsonSchema = {"type": "object"}
    if typed_dict.__doc__:
        definition["description"] = " ".join(typed_dict.__doc__.split())
    definitions[name] = {
        **definition,
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def snapshot_schema_bytes() -> bytes:
    """What `GET /api/schema` answers."""
    return json.dumps(json_schema(Snapshot), indent=1).encode()


def snapshot_reference() -> str:
    """README.md's table of the snapshot: a row per type, in the order a walk from the top
    meets them, with where it sits and its fields (`?`: not always there)."""
    schema = json_schema(Snapshot)
    definitions = cast(dict[str, JsonSchema], schema["$defs"])
    rows = ["| type | at | fields |", "| --- | --- | --- |"]
    places: dict[str, str] = {"Snapshot": ""}
    met = ["Snapshot"]  # grows as the walk meets new types
    for name in met:
        place = places[name]
        definition = definitions[name]
        properties = cast(dict[str, JsonSchema], definition["properties"])
        required = cast(list[str], definition["required"])
        fields = []
        for key, node in properties.items():
            optional = "" if key in required else "?"
            fields.append(f"{key}{optional}: {_shown(node)}")
            for found, inside in _named(node):
                if found not in places:
                    places[found] = f"{place}.{key}{inside}".lstrip(".")
                    met.append(found)
        at = f"`{place}`" if place else "the top"
        rows.append(f"| `{name}` | {at} | {', '.join(fields)} |")
    return "\n".join(rows)


def _shown(node: JsonSchema) -> str:
    """A schema as a reader writes a type: `int | null`, `[RequestRecord]`, `{str: int}`."""
    if "$ref" in node:
        return str(node["$ref"]).rsplit("/", 1)[1]
    if "anyOf" in node:
        return " \\| ".join(_shown(option) for option in cast(list[JsonSchema], node["anyOf"]))
    if "enum" in node:
        return " \\| ".join(json.dumps(value) for value in cast(list[object], node["enum"]))
    kind = node["type"]
    if kind == "array":
        return f"[{_shown(cast(JsonSchema, node['items']))}]"
    if kind == "object":
        return f"{{str: {_shown(cast(JsonSchema, node['additionalProperties']))}}}"
    return {"integer": "int", "number": "float", "string": "str", "boolean": "bool"}.get(
        str(kind), str(kind)
    )


def _named(node: JsonSchema, inside: str = "") -> list[tuple[str, str]]:
    """The types a schema refers to, directly or through unions, lists (`[]`: an item) and
    maps (`{}`: a value), each with the way in."""
    if "$ref" in node:
        return [(str(node["$ref"]).rsplit("/", 1)[1], inside)]
    found = [
        each
        for option in cast(list[JsonSchema], node.get("anyOf", []))
        for each in _named(option, inside)
    ]
    for key, step in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(node.get(key), dict):
            found += _named(cast(JsonSchema, node[key]), inside + step)
    return found
