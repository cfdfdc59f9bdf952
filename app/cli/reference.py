"""`python -m app.cli.reference [--write]`: README.md's reference tables, read off the code.

- flags: every option of every `sluice` subcommand, read off the parser `sluice` runs, with
  the default the settings take when nothing sets the flag;
- metrics: name, type, labels and help of every series, read off a fresh registry holding
  every collector a proxy and the supervisor of `--workers` register (`exported_registry`);
- endpoints: the proxy's paths (its route tables) and the dashboard's (its URL map), and
  the dashboard's snapshot, a row per type, read off its types (dashboard/schema.py).

Words a table needs that the code does not hold (what an endpoint is for) sit in this module,
keyed by what the code holds: a path the code serves without words here, or words for a path
it no longer serves, is an error, so the tables cannot drift from the code. Without `--write`
the tables are printed; with it, each replaces what is between its markers in README.md:

    <!-- reference:NAME -->
    (generated: never edited by hand)
    <!-- /reference:NAME -->

tests/test_reference.py checks that README.md holds what this module generates now.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from app.budgets.shared import SharedBudgets
from app.budgets.sync import BudgetCollector, BudgetSync
from app.cli.command import build_parser
from app.cli.rooms import RoomMetrics
from app.config import Settings
from app.dashboard.app import DashboardSources, create_dashboard
from app.dashboard.feed import DashboardFeed
from app.dashboard.schema import snapshot_reference
from app.observe.export_metrics import ExportCollector
from app.observe.kv_event_metrics import KvEventCollector
from app.observe.worker_metrics import WorkerInfo, merge_worker_metrics
from app.preprocess.endpoints import ENDPOINTS, STORED_RESPONSES
from app.proxy.app import GET_PATHS, STORED_METHODS
from app.sim.settings import SimSettings

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = re.compile(
    r"(?P<opening><!-- reference:(?P<name>[\w-]+) -->\n)(?P<body>.*?)"
    r"(?P<closing><!-- /reference:(?P=name) -->)",
    re.DOTALL,
)
# The settings each subcommand's flags fill: where a flag's default is when argparse has none
# (a flag left unset must not hide the environment's or the file's value).
SETTINGS: Mapping[str, type[Any]] = {
    "serve": Settings,
    "demo": Settings,
    "sim-backend": SimSettings,
}
# What each kind of inference endpoint is, by its `endpoint` label.
INFERENCE_WORDS = {
    "chat": "chat completions, streamed or not: rendered and tokenized, routed by prefix, "
    "the window checked",
    "completion": "completions: tokenized, routed by prefix, the window checked",
    "responses": "OpenAI's Responses: `instructions` + `input` rendered to route by prefix; "
    "`previous_response_id` to the engine that stores it",
    "messages": "Anthropic's Messages: `system` + `messages` rendered to route by prefix",
    "embeddings": "routed by model and load",
    "rerank": "routed by model and load",
    "score": "routed by model and load",
    "classify": "routed by model and load",
    "pooling": "routed by model and load",
    "tokenize": "routed by model and load (the engine's tokenizer answers)",
    "detokenize": "routed by model and load",
    "transcriptions": "multipart upload, routed by the form's `model` (the file is skipped)",
    "translations": "multipart upload, routed by the form's `model` (the file is skipped)",
}
PROXY_WORDS = {
    "/v1/models": "each served model with a backend taking its traffic, and its aliases "
    "(OpenAI's shape plus vLLM's `max_model_len`); with `--api-keys`, the caller's only",
    "/health": "200 while at least one backend takes traffic, else 503",
    "/metrics": "Prometheus text: this process's metrics (below)",
    STORED_RESPONSES + "{id}": "a stored response, on the engine that made it (its id's tag)",
}
# Each dashboard route, as "METHOD rule" (the rule as its URL map writes it): what it answers.
DASHBOARD_WORDS = {
    "GET /": "the page",
    "GET /static/<path:filename>": "the page's scripts, styles and charts",
    "GET /api/snapshot": "one JSON snapshot; `?records_after=SEQ` leaves out the request "
    "log's records up to that one, `?counters=1` only what the process counts",
    "GET /api/schema": "the snapshot's JSON schema, generated from its types (below)",
    "GET /api/events": "server-sent events: a snapshot at once, then one a second, the "
    "same bytes for every page; 503 past 32 pages",
    "PUT /api/policy": '`{"saturation": "wait"}` or `{"saturation": "bail-out"}`',
    "POST /api/demo/burst": "`sluice demo` only: a burst of large unique prompts now "
    '(202 `{"queued": true}`)',
    "GET /api/backends": "the backends, each with its `id`",
    "POST /api/backends": '`{"url": "http://HOST:PORT"}` adds a backend, probed at once '
    "(409 with `--workers`)",
    "DELETE /api/backends/<path:backend_id>": "no new request goes there, those in flight "
    "finish, the routing index forgets it (409 for the last one)",
    "GET /metrics": "Prometheus text: this process's, or with `--workers` every worker's "
    "under a `worker` label",
}
# A URL rule's variable part, `<path:name>`, shown as the proxy's paths show theirs: `{name}`.
RULE_PART = re.compile(r"<(?:\w+:)?(\w+)>")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join(
        "| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in lines
    )


# --- flags ---------------------------------------------------------------------------------


def subcommands() -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """Every `sluice` subcommand: what it does, in a line, and its parser."""
    (action,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    said = {choice.dest: str(choice.help) for choice in action._choices_actions}
    return {
        name: ((parser.description or said[name]).rstrip("."), parser)
        for name, parser in action.choices.items()
    }


def invocation(action: argparse.Action) -> str:
    """The flag as a user writes it: `--policy {a,b}`, `--[no-]hang`, `--backend URL`."""
    flag = next(o for o in action.option_strings if o.startswith("--"))
    if isinstance(action, argparse.BooleanOptionalAction):
        return "--[no-]" + action.option_strings[0].removeprefix("--")
    if action.nargs == 0:
        return flag
    if action.choices is not None:
        return f"{flag} {{{','.join(map(str, action.choices))}}}"
    return f"{flag} {action.metavar or action.dest.upper()}"


def shown_default(command: str, action: argparse.Action) -> str:
    value = action.default
    settings = SETTINGS.get(command)
    if value is None and settings is not None:
        fields = {f.name: f for f in dataclasses.fields(settings)}
        if action.dest in fields:
            value = fields[action.dest].default
    if isinstance(value, bool) and isinstance(action, argparse.BooleanOptionalAction):
        return "on" if value else "off"
    if value in (None, (), dataclasses.MISSING) or (action.nargs == 0 and value is False):
        return "-"
    return f"`{value}`"


def meaning(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % dict(vars(action), prog=parser.prog)
    if isinstance(action, argparse._AppendAction) and "repeatable" not in text:
        text += " (repeatable)"
    return text


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def flags_reference() -> str:
    commands = subcommands()
    serve_flags = {a.dest for a in options(commands["serve"][1])}
    parts = []
    for command, (summary, parser) in commands.items():
        actions = options(parser)
        lines = [f"`sluice {command}`: {summary}."]
        if command == "demo":
            flags = {a.dest for a in actions}
            lacks = sorted(serve_flags - flags)
            named = ", ".join(f"`--{dest.replace('_', '-')}`" for dest in lacks)
            lines.append(f"It takes `sluice serve`'s flags but {named}, and these of its own:")
            actions = [a for a in actions if a.dest not in serve_flags]
        rows = [
            (f"`{invocation(a)}`", shown_default(command, a), meaning(parser, a)) for a in actions
        ]
        lines.append(markdown_table(("flag", "default", "meaning"), rows))
        parts.append("\n\n".join(lines))
    return "\n\n".join(parts)


# --- metrics -------------------------------------------------------------------------------


class _Parsed(Collector):
    """Metric families read from an exposition's text (the supervisor's merged one)."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))

    def collect(self) -> Iterable[Metric]:
        return self.families


def exported_registry() -> CollectorRegistry:
    """A fresh registry holding every metric a proxy exports, whatever its flags (the
    collectors app/cli/sluice.py registers), and the supervisor's of `--workers`."""
    registry = RoomMetrics.create(clock=lambda: 0.0).registry
    registry.register(WorkerInfo(0))
    registry.register(BudgetCollector(BudgetSync(SharedBudgets(0), "redis://127.0.0.1")))
    registry.register(KvEventCollector(dict))
    registry.register(ExportCollector(dict, dict))
    registry.register(_Parsed(merge_worker_metrics({}, {0: True}, {0: 0}).decode()))
    return registry


def label_names(collector: object, family: Metric) -> list[str]:
    """A family's labels: from its samples when it has some, else as declared (prometheus_client
    keeps them in `_labelnames`, on its metric objects and on its families alike)."""
    for source in (family, collector):
        declared = getattr(source, "_labelnames", None)
        if declared:
            return list(declared)
    seen = dict.fromkeys(name for s in family.samples for name in s.labels)
    return [name for name in seen if name not in ("le", "quantile")]


def exposed_name(family: Metric) -> str:
    return family.name + "_total" if family.type == "counter" else family.name


def metric_rows(registry: CollectorRegistry) -> list[tuple[str, str, str, str]]:
    async def read() -> list[tuple[str, str, str, str]]:
        rows = []
        for collector in list(registry._collector_to_names):
            for family in collector.collect():
                labels = ", ".join(label_names(collector, family))
                rows.append((exposed_name(family), family.type, labels, family.documentation))
        return rows

    # Some collectors read the loop's clock (the budgets' connection state).
    return sorted(trio.run(read))


def metrics_reference() -> str:
    rows = [
        (f"`{name}`", kind, f"`{labels}`" if labels else "-", text)
        for name, kind, labels, text in metric_rows(exported_registry())
    ]
    return markdown_table(("metric", "type", "labels", "meaning"), rows)


# --- endpoints -----------------------------------------------------------------------------


def proxy_routes() -> list[tuple[str, str, str]]:
    """(method, path, what) of every path the proxy serves."""
    paths: dict[str, list[str]] = {}
    for path, endpoint in ENDPOINTS.items():
        paths.setdefault(endpoint.name, []).append(path)
    check_words("inference endpoint", set(paths), set(INFERENCE_WORDS))
    rows = [
        ("POST", ", ".join(f"`{p}`" for p in found), f"`{name}`: {INFERENCE_WORDS[name]}")
        for name, found in paths.items()
    ]
    stored = STORED_RESPONSES + "{id}"
    check_words("proxy path", {*GET_PATHS, stored}, set(PROXY_WORDS))
    rows += [("GET", f"`{path}`", PROXY_WORDS[path]) for path in sorted(GET_PATHS)]
    for action, methods in STORED_METHODS.items():
        verbs = ", ".join(m.decode() for m in methods)
        rows.append((verbs, f"`{stored}{action}`", PROXY_WORDS[stored]))
    return rows


def dashboard_routes() -> list[tuple[str, str, str]]:
    """(method, path, what) of every route of the dashboard, read off its URL map."""
    unused: Any = None
    sources = DashboardSources(unused, unused, unused, unused)
    app = create_dashboard(cast(DashboardFeed, unused), sources, None)
    served = {
        (method, rule.rule)
        for rule in app.url_map.iter_rules()
        for method in rule.methods or ()
        if method not in ("HEAD", "OPTIONS")
    }
    check_words(
        "dashboard route", {f"{method} {path}" for method, path in served}, set(DASHBOARD_WORDS)
    )
    ordered = sorted(served, key=lambda route: (route[1], route[0]))
    return [
        (method, "`" + RULE_PART.sub(r"{\1}", path) + "`", DASHBOARD_WORDS[f"{method} {path}"])
        for method, path in ordered
    ]


def check_words(what: str, served: set[Any], described: set[Any]) -> None:
    if served != described:
        raise LookupError(
            f"{what}s served without words in app/cli/reference.py: {sorted(served - described)};"
            f" words for none served: {sorted(described - served)}"
        )


def endpoints_reference() -> str:
    header = ("method", "path", "what")
    return "\n\n".join(
        [
            "The proxy (`--port`, 8000):",
            markdown_table(header, proxy_routes()),
            "The dashboard (`--dashboard-port`, 8001); a write needs the admin token when one "
            "is set and is refused from another origin:",
            markdown_table(header, dashboard_routes()),
            "The snapshot (`/api/snapshot`, described by `/api/schema`): times in seconds unless "
            "a name says `_ms`, `null` where nothing is known yet, `?` after a field that is not "
            "always there; `[]` is an item of a list, `{}` a value of a map whose keys are data "
            "(URLs, model names, codes):",
            snapshot_reference(),
        ]
    )


# --- README --------------------------------------------------------------------------------

REFERENCES: dict[str, Callable[[], str]] = {
    "flags": flags_reference,
    "metrics": metrics_reference,
    "endpoints": endpoints_reference,
}


def fill(text: str, generated: Mapping[str, str]) -> str:
    """`text` with each marked region holding `generated[name]`; a region of no known name
    is an error (a typo would otherwise leave stale text in place)."""

    def replace(match: re.Match[str]) -> str:
        return f"{match['opening']}{generated[match['name']]}\n{match['closing']}"

    unknown = {match["name"] for match in MARKER.finditer(text)} - set(generated)
    if unknown:
        raise LookupError(f"README regions of no reference: {sorted(unknown)}")
    return MARKER.sub(replace, text)


def generate() -> dict[str, str]:
    return {name: make() for name, make in REFERENCES.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.cli.reference", description=__doc__)
    parser.add_argument("--write", action="store_true", help="fill README.md's marked regions")
    args = parser.parse_args(argv)
    generated = generate()
    if not args.write:
        for name, text in generated.items():
            print(f"<!-- reference:{name} -->\n{text}\n<!-- /reference:{name} -->\n")
        return 0
    before = README.read_text()
    after = fill(before, generated)
    if after != before:
        README.write_text(after)
    print(f"README.md: {'updated' if after != before else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
