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
from typing import Literal, NotRequired, Required, Union

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
