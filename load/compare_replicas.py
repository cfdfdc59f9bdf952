"""`python -m load compare REV --replicas hot,rag`: two versions' routing across replicas.

    python -m load compare HEAD~1 --replicas hot,rag --rounds 3 --seconds 20

`bench replicas`' fleet (4 simulated GPUs publishing KV events, `sluice serve --policy
cache_aware` replicas with `--kv-events` behind a TCP round robin), this checkout's `app/`
against REV's on the same GPUs: each round starts fresh GPUs (their URLs are the names
rendezvous hashing places prompts by, so a round is one draw of where the prompts land), and
on them, for each workload, 1 and 4 replicas of each version, the versions' order alternating
round by round, the GPUs' caches emptied before each run. Reports each version's backend
prefix hit rate (the GPUs' own counters) and TTFT p50/p99 (and p99 of the requests sent after
the run's first quarter, "warm"), means over the rounds, and 4 replicas against one: issue
17's targets are ratios within one version.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import trio

from load import harness
from load.bench.replicas import Placements, fleet_run
from load.harness import Table
from load.processes import Stack

REPLICAS = (1, 4)
MEASURES = ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "ttft_p99_warm_ms")


async def measure(args: argparse.Namespace, source: Path) -> list[dict[str, Any]]:
    workloads = args.replicas.split(",")
    runs: list[dict[str, Any]] = []
    async with Stack() as stack:
        placements = Placements(stack)
        for number in range(1, args.rounds + 1):
            sims = await placements.for_round(number)
            versions: list[tuple[str, Path | None]] = [("this", None), ("rev", source)]
            if number % 2 == 0:
                versions.reverse()
            for workload in workloads:
                for replicas in REPLICAS:
                    for version, tree in versions:
                        harness.progress(
                            f"compare: round {number}/{args.rounds}, {workload}, "
                            f"{replicas} replica(s), {version}"
                        )
                        run = await fleet_run(
                            sims, replicas, True, workload, args.seconds, source=tree
                        )
                        runs.append(
                            {"round": number, "workload": workload, "replicas": replicas,
                             "version": version, **run}
                        )  # fmt: skip
    harness.progress("")
    return runs


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the rounds, by workload, version and replicas, and 4 replicas against 1."""
    result: dict[str, Any] = {}
    for workload in dict.fromkeys(run["workload"] for run in runs):
        for version in ("this", "rev"):
            means: dict[int, dict[str, float]] = {}
            for replicas in REPLICAS:
                mine = [
                    r
                    for r in runs
                    if (r["workload"], r["version"], r["replicas"]) == (workload, version, replicas)
                ]
                means[replicas] = {m: statistics.mean(r[m] for r in mine) for m in MEASURES}
                means[replicas]["errors"] = sum(r["errors"] for r in mine)
            one, many = means[REPLICAS[0]], means[REPLICAS[-1]]
            ratios = {m: many[m] / one[m] if one[m] else 0.0 for m in MEASURES}
            result[f"{workload} {version}"] = {"means": means, "many_to_one": ratios}
    return result


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    result = summary(runs)
    labels = {"this": "this checkout", "rev": args.rev}
    rows = []
    for key, entry in result.items():
        workload, version = key.split()
        for replicas, means in entry["means"].items():
            rows.append(
                [workload, labels[version], replicas, *(means[m] for m in MEASURES),
                 means["errors"]]
            )  # fmt: skip
        rows.append([workload, labels[version], "4 vs 1", *entry["many_to_one"].values(), ""])
    title = (
        f"replicas with KV events, {args.rounds} rounds (fresh GPUs each) of {args.seconds:g} s "
        "runs; means over the rounds"
    )
    headers = ["workload", "version", "replicas", "hit rate", "TTFT p50 ms", "p99 ms",
               "warm p99 ms", "errors"]  # fmt: skip
    print(harness.table_text(Table(title, headers, rows, digits=3)))
    blob = {**harness.provenance(), "rev": args.rev, "runs": runs, "summary": result}
    print(f"wrote {harness.write('compare-replicas', blob, args.out_dir)}")


def main(args: argparse.Namespace, source: Path) -> None:
    report(args, trio.run(measure, args, source))
