"""`python -m load compare REV`: this checkout's proxy against another version's, side by side.

    python -m load compare HEAD~3 --rate 100 --rounds 5

Exports REV's `app/` with `git archive` into a temporary directory, starts both versions of
`sluice serve` (default flags) in front of one instant simulated backend, and sends the
overhead scenario's one-token chats at a fixed open-loop rate, the two taking turns round by
round (these machines are noisy: only a ratio measured in one run means anything). Reports
for each: CPU per request (the process and its render workers, from /proc), added p50 and
p99 over calling the backend directly in the same rounds, and how often the stall
detector's lag probe ticked under that load.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

from load import harness, rawhttp
from load.bench.overhead import Samples
from load.harness import REPO, Table
from load.processes import Stack, tree_cpu
from load.stats import Ranged

PROBE_TICKS = "sluice_event_loop_lag_seconds_count"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rev", help="the git revision to compare with (e.g. HEAD~1, a tag)")
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per target")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of a round")
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


async def ticks(client: httpx.AsyncClient, url: str) -> float:
    return harness.metric(await harness.scrape(client, url), PROBE_TICKS) or 0.0


async def measure(args: argparse.Namespace, source: Path) -> dict[str, Any]:
    labels = {"this": f"this checkout ({REPO.name})", "rev": args.rev}
    async with Stack() as stack, httpx.AsyncClient(trust_env=False) as client:
        sim = await stack.sim(instant=True)
        urls = {"direct": sim, "this": await stack.proxy(sim)}
        urls["rev"] = await stack.proxy(sim, source=source)
        pools = {name: rawhttp.Pool(url) for name, url in urls.items()}
        for pool in pools.values():
            await pool.warm()
        samples = {name: Samples() for name in urls}
        probe_ticks = {name: 0.0 for name in urls}
        for number, name in harness.alternate(args.rounds, list(urls)):
            harness.progress(f"compare: round {number}/{args.rounds}, {name}")
            url = urls[name]
            proxy = name != "direct"
            cpu0 = tree_cpu(stack.pids[url]) if proxy else 0.0
            ticks0 = await ticks(client, url) if proxy else 0.0
            latencies, errors = await rawhttp.open_loop(
                pools[name], args.rate, args.seconds, number
            )
            samples[name].latencies += latencies
            samples[name].errors += errors
            if proxy:
                cpu = tree_cpu(stack.pids[url]) - cpu0
                samples[name].cpu_per_request.append(cpu / max(len(latencies) + errors, 1))
                probe_ticks[name] += await ticks(client, url) - ticks0
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


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="sluice-compare-") as directory:
        source = Path(directory)
        export(args.rev, source)
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
