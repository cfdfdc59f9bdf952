"""`python -m load compare REV`: this checkout's proxy against another version's, side by side.

    python -m load compare HEAD~3 --rate 100 --rounds 5
    python -m load compare HEAD~3 --clients 32 --rounds 8 --seconds 3
    python -m load compare HEAD~1 --replicas hot,rag --rounds 3 --seconds 20
    python -m load compare 4d1277e --bench streams --quick

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

With `--bench NAME` (streams, overhead, hardening, longprompts), that scenario instead, its
own workload, measurement and tables: its Sluice variant (`sluice`; hardening's `offload`)
started twice, from this checkout and from REV's tree (`sluice@REV`), taking turns with the
variants a ratio needs (direct) in alternating rounds (at least 2), peers, floors and
hardening's `inline` left out; `--quick`, `--rounds`, `--proxy-arg` and the scenario's own
options as in `bench`. Printed: the scenario's tables with both versions, then each figure
this/REV (longprompts': per shape req/s, CPU and loop-thread CPU per request, /health p99 and
max, blocking stall time per request: its check that a change added no loop stalls).
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

from load import bench, client, compare_replicas, drive, harness
from load.bench.longprompts import BLOCKING, stall_ms_per_request
from load.bench.overhead import Samples
from load.bench.replicas import WORKLOADS
from load.harness import REPO, Table
from load.processes import Stack, tree_cpu
from load.stats import Ranged, ranged

PROBE_TICKS = "sluice_event_loop_lag_seconds_count"
# The scenarios `--bench` runs, and the name of the Sluice variant each starts per version.
BENCHES = {
    "streams": "sluice",
    "overhead": "sluice",
    "hardening": "offload",
    "longprompts": "sluice",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rev", help="the git revision to compare with (e.g. HEAD~1, a tag)")
    parser.add_argument("--rate", type=float, help="requests per second (default 100)")
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
        "--rounds",
        type=int,
        help="rounds per target (default 4; with --replicas, 3; with --bench, the scenario's, "
        "at least 2)",
    )
    parser.add_argument(
        "--seconds", type=float, help="length of a round (default 5; with --replicas, 20)"
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=harness.default_out_dir(),
        help="where compare.json (compare-NAME.json) goes (default: %(default)s)",
    )
    scenario = parser.add_argument_group("a scenario's workload instead (--bench)")
    scenario.add_argument(
        "--bench",
        choices=BENCHES,
        help="that scenario, its Sluice variant from both versions by turns; figures this/REV",
    )
    scenario.add_argument("--quick", action="store_true", help="the scenario's --quick")
    scenario.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="one more flag for both versions' `sluice serve` (one both accept)",
    )
    for name in BENCHES:
        options = bench.scenario(name).options
        if options is not None:
            options(parser)  # streams' --streams, hardening's --part


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
    if args.bench:
        given = [f for f in ("rate", "clients", "replicas", "seconds") if getattr(args, f)]
        if given:
            raise SystemExit(f"python -m load compare: --bench runs without --{given[0]}")
        with tempfile.TemporaryDirectory(prefix="sluice-compare-") as directory:
            export(args.rev, Path(directory))
            compare_bench(args, Path(directory))
        return
    if args.rate is None:
        args.rate = 100.0
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


# -- compare REV --bench NAME -------------------------------------------------------------


def compare_bench(args: argparse.Namespace, source: Path) -> None:
    """The scenario run with its Sluice variant from both trees; its report, then the figures
    this/REV; `compare-NAME.json` written (the scenario's result, and those figures)."""
    scenario = bench.scenario(args.bench)
    suffix = f"@{args.rev}"
    blob = harness.measured(scenario, args, {"": None, suffix: source})
    variant = BENCHES[args.bench]
    rows = FIGURES[args.bench](blob["result"], variant, variant + suffix)
    keys = ("figure", "this", "rev", "this_to_rev", "better")
    blob |= {"rev": args.rev, "this_to_rev": [dict(zip(keys, row, strict=True)) for row in rows]}
    print(harness.report(scenario, blob))
    title = (
        f"{scenario.name}: this checkout ({variant}) against {args.rev} ({variant}{suffix}) in "
        f"the same run, load average {blob['machine']['load_average']:.1f} at the end; "
        "this/REV: this checkout's figure over REV's"
    )
    headers = ["figure", "this", args.rev, "this/REV", "better"]
    print("\n" + harness.table_text(Table(title, headers, rows, digits=2)))
    print(f"wrote {harness.write(f'compare-{scenario.name}', blob, args.out_dir)}")


def figure(what: str, this: Any, rev: Any, better: str) -> list[Any]:
    """One row: both versions' figure, this/REV (n/a where REV's is 0 or not a number)."""
    numbers = all(isinstance(v, int | float) for v in (this, rev))
    ratio = f"{this / rev:.3f}" if numbers and rev else None
    return [what, this, rev, ratio, better]


def keyed(
    where: str, mine: dict[str, Any], theirs: dict[str, Any], keys: tuple[tuple[str, str, str], ...]
) -> list[list[Any]]:
    """A row per (key, what, better) of two summaries: `where: what`, both, this/REV."""
    return [figure(f"{where}: {what}", mine[k], theirs[k], better) for k, what, better in keys]


STREAMS_KEYS = (
    ("tokens_per_s", "tokens/s", "higher"),
    ("cpu_ms_per_1000_tokens", "CPU ms per 1,000 tokens", "lower"),
    ("cpu_share_of_core", "CPU share of a core", "lower"),
    ("gap_p99_ms", "gap p99 ms", "lower"),
    ("health_p99_ms", "/health p99 ms (worst round)", "lower"),
    ("health_worst_ms", "/health max ms", "lower"),
    ("errors", "errors", "lower"),
)


def streams_figures(result: dict[str, Any], this: str, rev: str) -> list[list[Any]]:
    rows = []
    for count, targets in result["streams"].items():
        rows += keyed(f"{count} streams", targets[this], targets[rev], STREAMS_KEYS)
    return rows


def overhead_figures(result: dict[str, Any], this: str, rev: str) -> list[list[Any]]:
    rows = []
    for rate, targets in result["fixed_rates"].items():
        mine, theirs = targets[this], targets[rev]
        for key, what in (
            ("cpu_ms_per_request", "CPU ms/request"),
            ("added_p50_ms", "added p50 ms"),
            ("added_p99_ms", "added p99 ms"),
            ("errors", "errors"),
        ):
            rows.append(figure(f"{rate} req/s: {what}", mine[key], theirs[key], "lower"))
    per_s, rounds = result["closed_loop_32_req_per_s"], result["closed_loop_32_rounds"]
    by_round = ranged([a / b for a, b in zip(rounds[this], rounds[rev], strict=True)])
    rows.append(
        ["32 clients: requests/s (this/REV: by round, range)", per_s[this], per_s[rev],
         f"{by_round.value:.3f} ({by_round.low:.3f}-{by_round.high:.3f})", "higher"]
    )  # fmt: skip
    idle = result["idle_cpu_ms_per_s"]
    rows.append(figure("idle CPU ms/s", idle[this], idle[rev], "lower"))
    return rows


def finished(results: list[str]) -> tuple[int, int] | None:
    """Hardening's "12/12 answered 200" or "1000/1000 ended with [DONE]" summed over rounds."""
    counts = [r.split()[0].split("/") for r in results]
    if not all(len(c) == 2 and c[0].isdigit() and c[1].isdigit() for c in counts):
        return None
    return sum(int(c[0]) for c in counts), sum(int(c[1]) for c in counts)


def hardening_figures(result: dict[str, Any], this: str, rev: str) -> list[list[Any]]:
    rows = []
    for part, blob in result.items():
        if part == "processes_died":
            continue
        mine, theirs = blob["summary"][this], blob["summary"][rev]
        rows.append(
            figure(f"{part}: /health worst ms", mine["health_worst_ms"], theirs["health_worst_ms"],
                   "lower")
        )  # fmt: skip
        rows.append(
            figure(f"{part}: /health p99 ms (median)", mine["health_p99_ms"],
                   theirs["health_p99_ms"], "lower")
        )  # fmt: skip
        rounds = {v: [r for r in blob["rounds"] if r["variant"] == v] for v in (this, rev)}
        wall = {v: max(r["wall_s"] for r in rounds[v]) for v in rounds}
        what = "time to refuse s (worst)" if part == "huge-prompt" else "wall s (worst)"
        rows.append(figure(f"{part}: {what}", wall[this], wall[rev], "lower"))
        results = {v: [r["result"] for r in rounds[v]] for v in rounds}
        done = {v: finished(results[v]) for v in rounds}
        ended, whole = done[this], done[rev]
        if ended is not None and whole is not None:
            of = f"{ended[1]:,}" + (f" / {whole[1]:,}" if whole[1] != ended[1] else "")
            rows.append(figure(f"{part}: finished (of {of})", ended[0], whole[0], "higher"))
        else:
            mine_text, theirs_text = (" / ".join(dict.fromkeys(results[v])) for v in (this, rev))
            rows.append([f"{part}: result", mine_text, theirs_text, None, ""])
    return rows


LONGPROMPTS_KEYS = (
    ("requests_per_s", "requests/s", "higher"),
    ("cpu_ms_per_request", "CPU ms/request", "lower"),
    ("loop_ms_per_request", "loop thread CPU ms/request", "lower"),
    ("health_p99_ms", "/health p99 ms (median)", "lower"),
    ("health_max_ms", "/health max ms", "lower"),
    ("errors", "errors", "lower"),
)


def longprompts_figures(result: dict[str, Any], this: str, rev: str) -> list[list[Any]]:
    rows = []
    for shape, blob in result["shapes"].items():
        summary = blob["summary"]
        rows += keyed(shape, summary[this], summary[rev], LONGPROMPTS_KEYS)
        blocking = {
            v: sum(stall_ms_per_request(blob["rounds"], v).get(BLOCKING, {}).values())
            for v in (this, rev)
        }
        what = f"{shape}: blocking stalls ms/request"
        rows.append(figure(what, blocking[this], blocking[rev], "lower"))
    return rows


FIGURES = {
    "streams": streams_figures,
    "overhead": overhead_figures,
    "hardening": hardening_figures,
    "longprompts": longprompts_figures,
}
