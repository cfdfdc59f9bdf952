"""`python -m load bench discovery [--part k8s]`: engines that come and go under traffic, as
discovery finds them (issue 44). Each part is its own function and its own table:
`k8s` (load/bench/discovery_k8s.py) against the stand-in Kubernetes API server.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

from load.bench.discovery_k8s import k8s_table, k8s_targets, measure_k8s
from load.harness import Bench, Scenario, Table

PARTS: dict[str, Callable[[Bench], Awaitable[dict[str, Any]]]] = {"k8s": measure_k8s}
TARGETS: dict[str, Callable[[dict[str, Any]], list[str]]] = {"k8s": k8s_targets}
TABLES: dict[str, Callable[[dict[str, Any]], Table]] = {"k8s": k8s_table}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--part", action="append", choices=sorted(PARTS), help="one part (default: every part)"
    )


async def measure(bench: Bench) -> dict[str, Any]:
    parts: dict[str, Any] = {}
    for name in bench.args.part or sorted(PARTS):
        parts[name] = await PARTS[name](bench)
    targets = [line for name, part in parts.items() for line in TARGETS[name](part)]
    return {"parts": parts, "targets": targets}


def tables(result: dict[str, Any]) -> list[Table]:
    found = [TABLES[name](part) for name, part in result["parts"].items()]
    return [*found, Table("", ["target"], [[line] for line in result["targets"]])]


SCENARIO = Scenario(
    name="discovery",
    reproduces="issue 44",
    about="engines found by Kubernetes come and go under streamed traffic: joins, drains, none "
    "lost",
    reference=(
        "Issue 44's targets: Kubernetes stand-in: a rolling replacement of 8 pods (one at a\n"
        "time, Ready after a delay) under 50 req/s -> 0 lost, no request sent to a pod not\n"
        "Ready; a watch cut mid-stream and a 410 Gone -> relist, nothing missed; 1,000 pods\n"
        "listed -> discovery's CPU reported, the loop's worst stall under 10 ms."
    ),
    measure=measure,
    tables=tables,
    options=options,
)
