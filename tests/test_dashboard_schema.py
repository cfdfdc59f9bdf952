"""The snapshot's JSON schema (`GET /api/schema`, generated from the types in
app/dashboard/snapshot.py) against what uses it: every field the page's scripts read is in
the schema, and real snapshots (a proxy's, as a page and as a supervisor get it, and a
supervisor's merge of two) have exactly the schema's keys, with its types.

The scripts are read, not run: each variable that holds a part of the snapshot is known by
its path in it, either given below (a function's parameters, a loop's variables) or found
from its assignment (`const pool = model.pool || {}`); every `name.field[...].field` read
from such a variable is then walked through the schema."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from app.dashboard.schema import json_schema
from app.dashboard.snapshot import Snapshot
from app.dashboard.worker_snapshots import merge_snapshots
from tests.conftest import StartSim, StartSluice, wait_until

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "static" / "js"
SCHEMA = json_schema(Snapshot)

# Per script, the variables whose path in the snapshot cannot be read off an assignment
# ("[]": an item of a list, "{}": a value of a map). A name may stand for several paths in
# one script (two functions' parameters): a read passes when one of them has the field.
GIVEN: dict[str, dict[str, tuple[str, ...]]] = {
    "main.js": {"snapshot": ("",)},
    "connection.js": {"snapshot": ("",)},
    "control.js": {"snapshot": ("",)},
    "format.js": {},  # formatting only: reads no snapshot
    "charts.js": {
        "columns": ("series",),
        "h.summary": ("window.lag",),
        "b": ("window.lag.buckets[]",),
    },
    "panels/backends.js": {
        "snapshot": ("",),
        "traffic": ("backends[].traffic",),
        "events": ("backends[].kv_events",),
        "b": ("backends[]",),
        "model": ("models[]",),
        "rolePool": ("models[].disaggregation.pools{}",),
        "admission": ("admission",),
        "held": ("admission.models{}",),
        "block": ("routing", "admission.models{}"),
        "k": ("admission.models{}.keys{}",),
    },
    "panels/caches.js": {"snapshot": ("",)},
    "panels/loop.js": {"snapshot": ("",), "stall": ("loop.recent[]",), "recent": ("loop.recent",)},
    "panels/requests.js": {
        "snapshot": ("",),
        "record": ("requests.recent[]",),
        "r": ("requests.recent[]",),
        "m": ("models[]",),
    },
    "panels/tokenize.js": {"snapshot": ("",)},
    "panels/workers.js": {"snapshot": ("",), "row": ("workers.rows[]",), "n": ("notices[]",)},
}
# What JavaScript reads of a list, a string or a number that is not data.
BUILT_INS = frozenset(
    {
        "length",
        "map",
        "filter",
        "forEach",
        "reduce",
        "join",
        "slice",
        "splice",
        "some",
        "every",
        "find",
        "sort",
        "concat",
        "includes",
        "indexOf",
        "push",
        "split",
        "replace",
        "replaceAll",
        "startsWith",
        "toLowerCase",
        "toFixed",
    }
)
STEP = r"(?:\.[A-Za-z_$][\w$]*|\[[\w$'\"]*\])"
# `const name = a.b.c;`, or with a fallback for a missing block (`|| {}`); not a condition.
ASSIGNED = re.compile(
    rf"(?:const|let)\s+([A-Za-z_$][\w$]*)\s*=\s*([A-Za-z_$][\w$]*{STEP}*)"
    r"(?=\s*(?:\|\|\s*(?:\{\}|\[\])\s*)?;)"
)


def resolve(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The schemas a value of `node` may have: references followed, unions spread."""
    if "$ref" in node:
        return resolve(SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]])
    if "anyOf" in node:
        return [each for option in node["anyOf"] for each in resolve(option)]
    return [node]


def step(node: dict[str, Any], part: str) -> list[dict[str, Any]] | None:
    """Where `.field` or `[key]` leads from `node`: [] for a built-in (nothing more to check),
    None when the schema has no such field."""
    found: list[dict[str, Any]] = []
    known = False
    for option in resolve(node):
        kind = option.get("type")
        if part.startswith("["):
            if kind == "array":
                found.append(option["items"])
            elif isinstance(option.get("additionalProperties"), dict):
                found.append(option["additionalProperties"])
            known = True  # a key chosen at run time: not checked
        elif part[1:] in option.get("properties", {}):
            found.append(option["properties"][part[1:]])
        elif isinstance(option.get("additionalProperties"), dict):
            found.append(option["additionalProperties"])
        elif part[1:] in BUILT_INS and kind in ("array", "string", "number", "integer"):
            known = True
    return found if found or known else None


def walk(path: str) -> list[dict[str, Any]] | None:
    nodes: list[dict[str, Any]] = [SCHEMA]
    for part in re.findall(r"\[\]|\{\}|[^.\[\]{}]+", path):
        if part in ("[]", "{}"):
            nodes = [n for node in nodes for n in (step(node, "[_]") or [])]
        else:
            nodes = [n for node in nodes for n in (step(node, "." + part) or [])]
        if not nodes:
            return None
    return nodes


def reads(text: str, name: str) -> Iterator[tuple[str, list[str]]]:
    """Every chain of fields read from `name`: its text and its steps."""
    for match in re.finditer(rf"(?<![\w$.]){re.escape(name)}((?:{STEP})+)", text):
        yield match.group(0), re.findall(STEP, match.group(1))


def check_reads(text: str, aliases: dict[str, list[list[dict[str, Any]]]]) -> list[str]:
    """The reads of `text` that no path of their variable's has, and count them as checked."""
    missing = []
    for name, roots in aliases.items():
        for expression, parts in reads(text, name):
            ok = False
            for nodes in roots:
                for part in parts:
                    after = [n for node in nodes for n in (step(node, part) or [])]
                    if not after:
                        ok = any(step(node, part) is not None for node in nodes)
                        break
                    nodes = after
                else:
                    ok = True
                if ok:
                    break
            if not ok:
                missing.append(expression)
    return missing


def without_fallbacks(text: str) -> str:
    """`(x || {}).field` reads `x.field`: the fallback stands for a missing block."""
    return re.sub(r"\(([\w$.]+)\s*\|\|\s*(?:\{\}|\[\])\)", r"\1", text)


def aliases_of(script: str, text: str) -> dict[str, list[list[dict[str, Any]]]]:
    """The snapshot's parts each variable of `text` holds: given, or assigned from another."""
    aliases = {
        name: [nodes for path in paths if (nodes := walk(path))]
        for name, paths in GIVEN[script].items()
    }
    grew = True
    while grew:
        grew = False
        for name, source in ASSIGNED.findall(text):
            head, *rest = re.split(rf"(?={STEP})", source, maxsplit=1)
            parts = re.findall(STEP, rest[0]) if rest else []
            if head not in aliases or name in aliases:
                continue
            held = []
            for nodes in aliases[head]:
                for part in parts:
                    nodes = [n for node in nodes for n in (step(node, part) or [])]
                held += [nodes] if nodes else []
            if held:
                aliases[name] = held
                grew = True
    return aliases


def test_every_script_is_known_and_reads_only_fields_the_schema_has() -> None:
    scripts = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.js"))
    assert scripts == sorted(GIVEN)
    missing, checked = [], 0
    for script in scripts:
        text = without_fallbacks((SCRIPTS / script).read_text(encoding="utf-8"))
        aliases = aliases_of(script, text)
        checked += sum(1 for name in aliases for _ in reads(text, name))
        missing += [f"{script}: {read}" for read in check_reads(text, aliases)]
    assert missing == []
    assert checked > 250  # the scripts were read (332 reads when written)


def test_the_schema_knows_a_misread_field() -> None:
    aliases = aliases_of("panels/loop.js", "const loop = snapshot.loop || {};")
    assert check_reads("loop.lag.max_recent; loop.recent.length", aliases) == []
    assert check_reads("loop.lag.max_recnt", aliases) == ["loop.lag.max_recnt"]
    assert check_reads("snapshot.workers.rows[0].pid; snapshot.series.anything", aliases) == []


def mismatches(value: Any, node: dict[str, Any], where: str = "snapshot") -> list[str]:
    """Where `value` breaks the schema `node`: missing or unknown keys, wrong types."""
    options = resolve(node)
    if len(options) > 1:
        found = [mismatches(value, option, where) for option in options]
        return [] if any(not each for each in found) else min(found, key=len)
    (node,) = options
    if "enum" in node:
        return [] if value in node["enum"] else [f"{where}: {value!r} not in {node['enum']}"]
    kind = node["type"]
    types = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "integer": int,
        "number": (int, float),
        "null": type(None),
    }
    if not isinstance(value, types[kind]) or (kind in ("integer", "number") and value is True):
        return [f"{where}: {value!r} is not {kind}"]
    if kind == "array":
        return [e for i, item in enumerate(value) for e in mismatches(item, node["items"], where)]
    if kind != "object":
        return []
    properties = node.get("properties", {})
    errors = [f"{where}.{key}: missing" for key in node.get("required", ()) if key not in value]
    for key, item in value.items():
        if key in properties:
            errors += mismatches(item, properties[key], f"{where}.{key}")
        elif isinstance(node.get("additionalProperties"), dict):
            errors += mismatches(item, node["additionalProperties"], f"{where}.{{}}")
        else:
            errors.append(f"{where}.{key}: not in the schema")
    return errors


async def test_real_snapshots_match_the_served_schema(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sims = [await start_sim(), await start_sim()]
    running = await start_sluice([sim.url for sim in sims])
    chat = {"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
    for stream in (False, True, False):
        answer = await client.post(
            running.proxy_url + "/v1/chat/completions", json={**chat, "stream": stream}
        )
        assert answer.status_code == 200

    async def snapshot(query: str = "") -> Any:
        answer = await client.get(f"{running.dashboard_url}/api/snapshot{query}")
        return json.loads(answer.content)

    async def logged() -> bool:
        return len((await snapshot())["requests"]["recent"]) == 3

    await wait_until(logged)
    served = await client.get(running.dashboard_url + "/api/schema")
    assert served.headers["content-type"] == "application/json"
    assert served.json() == SCHEMA
    page, counters = await snapshot(), await snapshot("?counters=1")
    assert {"window", "series", "dashboard"} <= page.keys()
    assert mismatches(page, SCHEMA) == []
    assert mismatches(counters, SCHEMA) == []
    assert mismatches(merge_snapshots([counters, counters]), SCHEMA) == []
    # The values that show the blocks the snapshot holds were there to be checked.
    assert page["backends"][0]["traffic"]["requests_total"] >= 1
    assert page["routing"]["cache_aware"]["index"]["blocks"] >= 0
