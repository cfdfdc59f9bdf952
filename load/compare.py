"""`python -m load compare REV`: this checkout's proxy against another version's, side by side.

    python -m load compare HEAD~3 --rate 100 --rounds 5
    python -m load compare HEAD~3 --clients 32 --rounds 8 --seconds 3
    python -m load compare HEAD~1 --replicas hot,rag --rounds 3 --seconds 20

Exports REV's `app/` with `git archive` into a temporary directory, starts both versions of
`sluice serve` (default flags) in front of one instant simulated backend, and sends the
overhead scenario's one-token chats, the two taking turns round by round (these machines are
noisy: only a ratio measured in one run means anything). At a fixed open-loop rate
(`--rate`) it reports for each: CPU per request (the process and its render workers, from
/proc), added p50 and p99 over calling the backend directly in the same rounds, and how often
the stall detector's lag probe ticked under that load. With `--clients N`, N closed-loop
clients instead (`bench overhead`'s throughput test, where the proxy's one core is the
limit): requests per second and CPU per request, medians over the rounds, and the median of
each round's ratio this/REV. With `--replicas WORKLOADS`, routing across replicas instead
(compare_replicas.py).
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import trio

from load import client, compare_replicas, drive, harness
from load.bench.overhead import Samples
from load.bench.replicas import WORKLOADS
from load.harness import REPO, Table
from load.processes import Stack, tree_cpu
from load.stats import Ranged, ranged

PROBE_TICKS = "sluice_event_loop_lag_seconds_count"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rev", help="the git revision to compare with (e.g. HEAD~1, a tag)")
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second")
    parser.add_argument(
        "--clients", type=int, default=0, help="closed-loop clients instead of --rate"
    )
    parser.add_argument(
        "--replicas",
        metavar="WORKLOADS",
        help="routing across 1 and 4 replicas instead, on these of bench replicas' workloads "
        "(comma-separated: rag, chat, hot)",
    )
    parser.add_argument(
        "--rounds", type=int, help="rounds per target (default 4; with --replicas, 3)"
    )
    parser.add_argument(
        "--seconds", type=float, help="length of a round (default 5; with --replicas, 20)"
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=harness.default_out_dir(),
        help="where compare.json goes (default: %(default)s)",
    )


def export(rev: str, into: Path) -> None:
    """REV's `app/` (and what it reads at run time: `static/`, `templates/`) into `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "app", "static", "templates"],
        capture_output=True,
        check=False,
    )
    if archive.returncode:
        reason = archive.stderr.decode(errors="replace").strip()
        raise SystemExit(f"python -m load compare: cannot export {rev!r}: {reason}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")


async def ticks(url: str) -> float:
    return harness.metric(await harness.scrape(url), PROBE_TICKS) or 0.0


async def measure(args: argparse.Namespace, source: Path) -> dict[str, Any]:
    labels = {"this": f"this checkout ({REPO.name})", "rev": args.rev}
    async with Stack() as stack:
        sim = await stack.sim(instant=True)
        urls = {"direct": sim, "this": await stack.proxy(sim)}
        urls["rev"] = await stack.proxy(sim, source=source)
        pools = {name: client.Pool(url) for name, url in urls.items()}
        for pool in pools.values():
            await pool.warm()
        samples = {name: Samples() for name in urls}
        probe_ticks = {name: 0.0 for name in urls}
        for number, name in harness.alternate(args.rounds, list(urls)):
            harness.progress(f"compare: round {number}/{args.rounds}, {name}")
            url = urls[name]
            proxy = name != "direct"
            cpu0 = tree_cpu(stack.pids[url]) if proxy else 0.0
            ticks0 = await ticks(url) if proxy else 0.0
            pool = pools[name]
            plan = drive.poisson(
                pool.prepare(client.ONE_TOKEN_REQUEST), args.rate, args.seconds, number
            )
            run = await drive.open_loop(pool, plan)
            samples[name].latencies += run.latencies()
            samples[name].errors += run.errors
            if proxy:
                cpu = tree_cpu(stack.pids[url]) - cpu0
                samples[name].cpu_per_request.append(cpu / max(len(run.records), 1))
                probe_ticks[name] += await ticks(url) - ticks0
        for pool in pools.values():
            await pool.close()
    harness.progress("")
    direct = samples["direct"].latencies
    seconds = args.rounds * args.seconds
    return {
        labels[name]: {
            **samples[name].report(direct),
            "probe_ticks_per_s": probe_ticks[name] / seconds,
        }
        for name in ("this", "rev")
    }


async def measure_closed_loop(args: argparse.Namespace, source: Path) -> dict[str, Any]:
    labels = {"this": f"this checkout ({REPO.name})", "rev": args.rev}
    async with Stack() as stack:
        sim = await stack.sim(instant=True)
        urls = {"this": await stack.proxy(sim), "rev": await stack.proxy(sim, source=source)}
        pools = {name: client.Pool(url) for name, url in urls.items()}
        for pool in pools.values():
            await pool.warm(200)
        per_s: dict[str, list[float]] = {name: [] for name in urls}
        cpu: dict[str, list[float]] = {name: [] for name in urls}
        errors = dict.fromkeys(urls, 0)
        for number, name in harness.alternate(args.rounds, list(urls)):
            harness.progress(f"compare: round {number}/{args.rounds}, {name}")
            pid = stack.pids[urls[name]]
            cpu0 = tree_cpu(pid)
            pool = pools[name]
            run = await drive.closed_loop(
                pool, args.clients, drive.one_token(pool), seconds=args.seconds
            )
            per_s[name].append(run.ok / run.seconds)
            cpu[name].append((tree_cpu(pid) - cpu0) / max(run.ok, 1))
            errors[name] += run.errors
    harness.progress("")
    ratios = [this / rev for this, rev in zip(per_s["this"], per_s["rev"], strict=True)]
    result: dict[str, Any] = {}
    for name in urls:
        throughput, cost = ranged(per_s[name]), ranged(cpu[name])
        result[labels[name]] = {
            "requests_per_s": throughput.value,
            "requests_per_s_range": [throughput.low, throughput.high],
            "cpu_ms_per_request": cost.value * 1e3,
            "cpu_ms_per_request_range": [cost.low * 1e3, cost.high * 1e3],
            "errors": errors[name],
        }
    result["round_ratio_this_to_rev"] = ranged(ratios)._asdict()
    return result


def main(args: argparse.Namespace) -> None:
    replicas = args.replicas is not None
    if replicas and not set(args.replicas.split(",")) <= set(WORKLOADS):
        raise SystemExit(f"python -m load compare: --replicas takes some of {', '.join(WORKLOADS)}")
    if args.rounds is None:
        args.rounds = 3 if replicas else 4
    if args.seconds is None:
        args.seconds = 20.0 if replicas else 5.0
    with tempfile.TemporaryDirectory(prefix="sluice-compare-") as directory:
        source = Path(directory)
        export(args.rev, source)
        if replicas:
            compare_replicas.main(args, source)
            return
        if args.clients:
            closed = trio.run(measure_closed_loop, args, source)
            report_closed_loop(args, closed)
            return
        result = trio.run(measure, args, source)
    columns = ("cpu_ms_per_request", "added_p50_ms", "added_p99_ms", "probe_ticks_per_s")
    rows = [
        [name, Ranged(r[columns[0]], *r[columns[0] + "_range"]), *(r[c] for c in columns[1:]),
         r["errors"]]
        for name, r in result.items()
    ]  # fmt: skip
    title = f"{args.rate:g} req/s, {args.rounds} alternating rounds of {args.seconds:g} s"
    headers = ["proxy", "CPU ms/request", "added p50 ms", "added p99 ms", "probe ticks/s"]
    print(harness.table_text(Table(title, [*headers, "errors"], rows, digits=2)))
    blob = {**harness.provenance(), "rev": args.rev, "rate": args.rate, "result": result}
    print(f"wrote {harness.write('compare', blob, args.out_dir)}")


def report_closed_loop(args: argparse.Namespace, result: dict[str, Any]) -> None:
    ratio = result["round_ratio_this_to_rev"]
    rows = [
        [
            name,
            Ranged(r["requests_per_s"], *r["requests_per_s_range"]),
            Ranged(r["cpu_ms_per_request"], *r["cpu_ms_per_request_range"]),
            r["errors"],
        ]
        for name, r in result.items()
        if name != "round_ratio_this_to_rev"
    ]
    title = (
        f"{args.clients} closed-loop clients, {args.rounds} alternating rounds of "
        f"{args.seconds:g} s; this/rev requests/s by round: "
        f"{ratio['value']:.3f} ({ratio['low']:.3f}-{ratio['high']:.3f})"
    )
    headers = ["proxy", "requests/s", "CPU ms/request", "errors"]
    print(harness.table_text(Table(title, headers, rows, digits=3)))
    blob = {**harness.provenance(), "rev": args.rev, "clients": args.clients, "result": result}
    print(f"wrote {harness.write('compare', blob, args.out_dir)}")
