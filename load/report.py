"""`python -m load report [NAME ...] [--write]`: the reference results' tables, as Markdown.

A scenario's reference result is `load/reference/NAME.json`, one run's JSON as the harness
writes it (`python -m load bench NAME --out-dir load/reference` refreshes it). Its tables are
the scenario's own (`Scenario.tables`, what the bench prints when it ends), rendered as
Markdown under one line of provenance: when, which commit, the machine's load, a link to
the JSON. Without `--write` they are printed; with it, each goes between its markers in the
READMEs, replacing what was there:

    <!-- report:NAME -->              every table of NAME
    <!-- report:NAME tables=1,3 -->   its first and third
    (generated: never edited by hand)
    <!-- /report:NAME -->
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from load import bench
from load.harness import REPO, table_markdown

REFERENCE = Path(__file__).resolve().with_name("reference")
READMES = (REPO / "load" / "README.md", REPO / "README.md")
MARKER = re.compile(
    r"<!-- report:(?P<name>[\w-]+)(?: tables=(?P<tables>\d+(?:,\d+)*))? -->\n"
    r"(?P<body>.*?)"
    r"<!-- /report:(?P=name) -->",
    re.DOTALL,
)


def render(
    name: str, blob: Mapping[str, Any], tables: Sequence[int] | None = None, link: str = ""
) -> str:
    """The Markdown of one result: its provenance, then its tables (`tables`: which, from
    1; all by default)."""
    made = bench.scenario(name).tables(dict(blob["result"]))
    chosen = made if tables is None else [made[i - 1] for i in tables if 0 < i <= len(made)]
    machine = blob.get("machine", {})
    head = f"**{blob['date']}**, commit {blob['commit'] or 'unknown'}"
    if machine:
        head += f", {machine['cpus']} CPUs, load average {machine['load_average']:.1f} at the end"
    head += f", {blob['seconds']:,.0f} s" + (", `--quick`" if blob.get("quick") else "")
    head += f" ([JSON]({link}))." if link else "."
    parts = [table_markdown(t) for t in chosen] or [""]
    parts[0] = f"{head} {parts[0]}".rstrip()
    deaths = blob["result"].get("processes_died", [])
    parts += [f"A process died during the run: {death}" for death in deaths]
    return "\n\n".join(parts) + "\n"


def fill(text: str, render_one: Callable[[str, Sequence[int] | None], str | None]) -> str:
    """`text` with every marked region replaced by `render_one(name, tables)`; a region
    whose result it does not give (None) is left as it was."""

    def replace(match: re.Match[str]) -> str:
        tables = [int(t) for t in match["tables"].split(",")] if match["tables"] else None
        body = render_one(match["name"], tables)
        if body is None:
            return match[0]
        opening = match[0][: match.start("body") - match.start()]
        return f"{opening}{body}\n<!-- /report:{match['name']} -->"

    return MARKER.sub(replace, text)


def marked(text: str) -> list[str]:
    return [match["name"] for match in MARKER.finditer(text)]


def load_results(names: Sequence[str], directory: Path) -> dict[str, dict[str, Any]]:
    found = {}
    for name in names:
        path = directory / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"report: no result for {name!r} ({path} does not exist)")
        found[name] = json.loads(path.read_text())
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME", help="scenarios (default: all)")
    parser.add_argument(
        "--write",
        action="store_true",
        help="replace the marked regions of load/README.md and README.md instead of printing",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        default=REFERENCE,
        help="where the NAME.json files are (default: %(default)s)",
    )


def main(args: argparse.Namespace) -> None:
    unknown = set(args.names) - set(bench.NAMES)
    if unknown:
        raise SystemExit(f"report: no scenario named {', '.join(sorted(unknown))}")
    if not args.write:
        names = args.names or [n for n in bench.NAMES if (args.reference / f"{n}.json").exists()]
        for name, blob in load_results(names, args.reference).items():
            link = os.path.relpath(args.reference / f"{name}.json")
            print(f"### `{name}` ({blob['reproduces']})\n\n{render(name, blob, link=link)}")
        return
    wanted = set(args.names or bench.NAMES)
    for readme in READMES:
        filled = write(readme, wanted, args.reference)
        where = readme.relative_to(REPO) if readme.is_relative_to(REPO) else readme
        print(f"{where}: {', '.join(filled) or 'no marked region'}")
    missing = wanted - {n for readme in READMES for n in marked(readme.read_text())}
    if args.names and missing:
        print(f"no marked region for {', '.join(sorted(missing))}")


def write(readme: Path, wanted: set[str], reference: Path) -> list[str]:
    """Fill `readme`'s marked regions of the `wanted` scenarios; their names."""
    text = readme.read_text()
    names = [n for n in dict.fromkeys(marked(text)) if n in wanted]
    results = load_results(names, reference)

    def render_one(name: str, tables: Sequence[int] | None) -> str | None:
        if name not in results:
            return None
        link = os.path.relpath(reference / f"{name}.json", readme.parent)
        return render(name, results[name], tables, link)

    updated = fill(text, render_one)
    if updated != text:
        readme.write_text(updated)
    return names
