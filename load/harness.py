"""What every benchmark shares, so that a scenario only declares its variants, workload and
table: the `Scenario` record, alternating rounds with a progress line, the /health probe in a
process of its own, Prometheus scrapes, and the JSON + PNG written (with date, commit and
machine) to `--out-dir`, outside the checkout unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio

from load import client, drive
from load.drive import Ticker, progress
from load.processes import Stack, forget_held_with_room, held_with_room, tree_cpu
from load.stats import Ranged, by_group, paired_change, with_range

REPO = Path(__file__).resolve().parent.parent
CODE = (":(glob)app/**/*.py", ":(glob)load/**/*.py")  # what a measurement depends on
BUSY_COLUMNS = ("requests_per_s", "cpu_us_per_request")


def default_out_dir() -> Path:
    """`$XDG_CACHE_HOME/sluice-load` (~/.cache/sluice-load): never inside the checkout."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "sluice-load"


@dataclass
class Table:
    title: str
    headers: Sequence[str]
    rows: Sequence[Sequence[Any]]
    digits: int = 1


@dataclass
class Bench:
    """What a scenario's `measure` gets: its options, its processes, and rounds."""

    args: argparse.Namespace
    stack: Stack
    name: str
    # Where `proxies` runs Sluice from, by the suffix of the variant's name: this checkout
    # (a bench), or also another version's `app/` ({"": None, "@REV": tree}: compare --bench).
    sources: dict[str, Path | None] = field(default_factory=lambda: {"": None})

    @property
    def quick(self) -> bool:
        return bool(self.args.quick)

    @property
    def comparing(self) -> bool:
        """Two versions of Sluice side by side (`python -m load compare REV --bench NAME`):
        peers, floors and other variants left out but for those a ratio needs (direct)."""
        return len(self.sources) > 1

    def rounds(self, quick: int, full: int) -> int:
        """--rounds, else the scenario's default; when comparing, at least 2 (each version
        goes first once)."""
        default = quick if self.quick else full
        return int(self.args.rounds or (max(default, 2) if self.comparing else default))

    async def proxies(
        self, variant: str, backends: str | Sequence[str], *flags: str
    ) -> dict[str, str]:
        """The Sluice variant `variant` (`sluice serve` before `backends` with `flags`), one
        process per source: {variant + suffix: URL}, e.g. {"sluice": ..., "sluice@REV": ...}."""
        return {
            variant + suffix: await self.stack.proxy(backends, *flags, source=source)
            for suffix, source in self.sources.items()
        }

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    async def alternate(
        self,
        rounds: int,
        variants: Sequence[str],
        one: Callable[[str, int], Awaitable[dict[str, Any]]],
        label: str = "",
    ) -> list[dict[str, Any]]:
        """`one(variant, round)` for every variant in each round, the order reversed every
        other round (drift on a shared machine falls on all alike); its rows, tagged."""
        rows: list[dict[str, Any]] = []
        steps = list(alternate(rounds, variants))
        for index, (number, variant) in enumerate(steps, start=1):
            progress(
                f"{self.name}{label}: round {number}/{rounds}, {variant} [{index}/{len(steps)}]"
            )
            rows.append({"round": number, "variant": variant, **await one(variant, number)})
        progress("")
        return rows


@dataclass(frozen=True)
class Scenario:
    """One claim, measured: `measure` runs the variants side by side as processes and returns
    the JSON blob; `in_process` measures what needs no process (before any starts, outside
    the event loop), its blob under "in_process"; `tables` and `plot` read the result."""

    name: str
    reproduces: str  # the seed or issue whose figures this is read against
    about: str  # one line for `bench --list`
    reference: str  # the seed's or issue's own figures, printed under the tables
    tables: Callable[[dict[str, Any]], list[Table]]
    measure: Callable[[Bench], Awaitable[dict[str, Any]]] | None = None
    in_process: Callable[[Bench], dict[str, Any]] | None = None
    plot: Callable[[dict[str, Any], Path], None] | None = None
    options: Callable[[argparse.ArgumentParser], None] | None = None


def at_least_one(text: str) -> int:
    """An option's count (streams, clients): a whole number, 1 or more."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {count}")
    return count


def alternate(rounds: int, variants: Sequence[str]) -> Iterator[tuple[int, str]]:
    for index in range(rounds):
        for variant in variants if index % 2 == 0 else list(reversed(variants)):
            yield index + 1, variant


__all__ = ["Ticker", "progress"]  # re-exported: every scenario reaches them through here


# -- talking to the servers -------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value}."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                samples[key] = float(value)
            except ValueError:
                continue
    return samples


async def scrape(url: str) -> dict[str, float]:
    reply = await client.call(url + "/metrics")
    if reply.status != 200:
        raise RuntimeError(f"{url}/metrics answered {reply.status}")
    return parse_metrics(reply.text)


def metric(samples: dict[str, float], name: str) -> float | None:
    """The sum of every series of `name` (all label sets); None when absent."""
    values = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    return sum(values) if values else None


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    now = metric(after, name)
    return None if now is None else now - (metric(before, name) or 0.0)


def label_values(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    """{label value: summed value} over the series of `name`; {} when absent."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        if key.startswith(name + "{"):
            for part in key[len(name) + 1 : -1].split(","):
                k, _, v = part.partition("=")
                if k == label:
                    out[v.strip('"')] = out.get(v.strip('"'), 0.0) + value
    return out


LAG_BUCKET = 'sluice_event_loop_lag_seconds_bucket{le="'


def lag_max_bucket(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The smallest lag bucket bound that holds every lag sample taken between the scrapes."""
    buckets = sorted(
        (float(key[len(LAG_BUCKET) : -2]), after[key] - before.get(key, 0.0))
        for key in after
        if key.startswith(LAG_BUCKET)
    )
    if not buckets or buckets[-1][1] == 0:
        return None
    return next(bound for bound, count in buckets if count >= buckets[-1][1])


async def wait_healthy(url: str) -> None:
    """Wait (30 s at most) until `url` answers /health with 200."""
    with trio.fail_after(30):
        while True:
            try:
                if (await client.call(url + "/health", give_up_s=5)).status == 200:
                    return
            except client.FAILURES:
                pass
            await trio.sleep(0.1)


async def answers(url: str, headers: dict[str, str], body: dict[str, Any]) -> bool:
    """Wait (60 s at most) until `url` answers a chat request with 200 (a peer may register
    its workers late)."""
    with trio.move_on_after(60):
        while True:
            try:
                reply = await client.call(
                    url + client.CHAT, "POST", json_body=body, headers=headers, give_up_s=5
                )
                if reply.status == 200:
                    return True
            except client.FAILURES:
                pass
            await trio.sleep(0.5)
    return False


async def busy_round(pool: client.Pool, pid: int, clients: int, seconds: float) -> dict[str, Any]:
    """`clients` closed-loop clients sending one-token chats for `seconds`: the throughput
    and the CPU per request of process `pid` (and its children)."""
    cpu0 = tree_cpu(pid)
    run = await drive.closed_loop(pool, clients, drive.one_token(pool), seconds=seconds)
    cpu = tree_cpu(pid) - cpu0
    return {
        "requests_per_s": run.ok / run.seconds,
        "cpu_us_per_request": cpu / max(run.ok, 1) * 1e6,
        "errors": run.errors,
    }


def busy_summary(rows: list[dict[str, Any]], variant: str, baseline: str) -> dict[str, Any]:
    """Rounds of `busy_round`: per variant medians with ranges, and `variant` against
    `baseline` in the same round (CPU per request and throughput, percent)."""
    return {
        "summary": by_group(rows, "variant", BUSY_COLUMNS),
        "cpu_change_pct": list(paired_change(rows, "cpu_us_per_request", variant, baseline)),
        "throughput_change_pct": list(paired_change(rows, "requests_per_s", variant, baseline)),
        "rounds": rows,
    }


def busy_table(blob: dict[str, Any], what: str, clients: int, target: str) -> Table:
    cpu, throughput = Ranged(*blob["cpu_change_pct"]), Ranged(*blob["throughput_change_pct"])
    summary = blob["summary"]
    rounds = next(iter(summary.values()))["rounds"]
    return Table(
        f"{clients} clients, medians of {rounds} alternating rounds (range); {what} in the same "
        f"round: CPU per request {cpu.value:+.1f}% ({cpu.low:+.1f} to {cpu.high:+.1f}), "
        f"throughput {throughput.value:+.1f}% ({throughput.low:+.1f} to {throughput.high:+.1f}); "
        f"target: {target}",
        ["variant", "req/s", "CPU us/request", "errors"],
        [[v, *(with_range(r, c) for c in BUSY_COLUMNS), r["errors"]] for v, r in summary.items()],
    )


@asynccontextmanager
async def health_probe(url: str, interval: float) -> AsyncIterator[dict[str, Any]]:
    """load/probe.py (a process of its own, so the load generator's work never shows as the
    proxy's latency) sends GET /health every `interval` s while the body runs; the dict then
    holds its summary: probes, worst_s, p99_s, p50_s, failures."""
    summary: dict[str, Any] = {}
    probe = await trio.lowlevel.open_process(
        [sys.executable, "-m", "load.probe", url, str(interval)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert probe.stdin is not None and probe.stdout is not None
    try:
        await _read_line(probe.stdout)  # "ready"
        yield summary
        await probe.stdin.send_all(b"stop\n")
        summary.update(json.loads(await _read_line(probe.stdout)))
    finally:
        probe.kill()
        await probe.wait()


async def _read_line(stream: trio.abc.ReceiveStream) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = await stream.receive_some(1)
        if not chunk:
            raise RuntimeError("the /health probe exited early")
        line += chunk
    return line


# -- reports ------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 1) -> str:
    if isinstance(value, Ranged):
        low, high = fmt(value.low, digits), fmt(value.high, digits)
        return fmt(value.value, digits) + ("" if low == high else f" ({low}-{high})")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def table_text(table: Table) -> str:
    cells = [[str(h) for h in table.headers]]
    cells += [[fmt(c, table.digits) for c in row] for row in table.rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(table.headers))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return (f"{table.title}\n" if table.title else "") + "\n".join(lines)


def targets_met(checks: Sequence[str], whose: str) -> str:
    """Target lines ("PASS ...", "FAIL ...", "n/a ...") in a few words, for a table's title:
    `issue 9's targets: 10 of 10 met` or `...: 8 of 10 met; not met: <each failed one>`."""
    passed = sum(line.startswith("PASS") for line in checks)
    failed = [line[5:] for line in checks if line.startswith("FAIL")]
    text = f"{whose} targets: {passed} of {passed + len(failed)} met"
    return text + (f"; not met: {'; '.join(failed)}" if failed else "")


def table_markdown(table: Table) -> str:
    """The same table as Markdown, its title on the line above it (GitHub's renderer lets a
    table with leading pipes follow a paragraph): what `python -m load report` writes."""

    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    lines = [row([str(h) for h in table.headers]), row(["---"] * len(table.headers))]
    lines += [row([fmt(c, table.digits) for c in cells]) for cells in table.rows]
    title = table.title[:1].upper() + table.title[1:]
    return (f"{title}:\n" if title else "") + "\n".join(lines)


def provenance() -> dict[str, Any]:
    """When, at which commit (`+changes` if the code of app/ or load/ differs from it), and
    on what machine (its load average: others' work on it shows there)."""
    commit = None
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    if head.returncode == 0:
        changes = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", *CODE],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        commit = head.stdout.strip() + ("+changes" if changes else "")
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg()[0],
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }


def png_beside(json_path: Path) -> Path | None:
    """Where a result's PNG goes: beside its JSON, unless that is inside the checkout
    (`--out-dir load/reference` refreshes a reference: JSON only, no figure tracked)."""
    if json_path.resolve().is_relative_to(REPO):
        print(f"no PNG written: {json_path.parent} is inside the checkout", file=sys.stderr)
        return None
    return json_path.with_suffix(".png")


def write(name: str, blob: dict[str, Any], out_dir: Path) -> Path:
    """`<out_dir>/<name>.json`; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(blob, indent=1))
    return path


def report(scenario: Scenario, blob: dict[str, Any]) -> str:
    """The tables of a result, with its provenance and the figures to read them against."""
    head = f"== {scenario.name} ({blob['date']}, {blob['commit']}; {scenario.reproduces}) =="
    tables = "\n\n".join(table_text(t) for t in scenario.tables(blob["result"]))
    held = blob.get("held_with_room")
    if held and held["proxies"]:
        tables += (
            f"\nHeld while an engine reported room: {held['seconds']:g} s in all, over "
            f"{held['proxies']} Sluice process(es) (issue 40: 0)"
        )
    for death in blob["result"].get("processes_died", []):
        tables += f"\n!! died during the run: {death}"
    return f"{head}\n{tables}\n\n{scenario.reference}"


def measured(
    scenario: Scenario, args: argparse.Namespace, sources: dict[str, Path | None] | None = None
) -> dict[str, Any]:
    """Measure (`sources`: see `Bench.sources`); the blob, with its provenance."""

    bench = Bench(args, Stack(args.proxy_arg), scenario.name, sources or {"": None})

    async def measure() -> dict[str, Any]:
        assert scenario.measure is not None
        async with bench.stack:
            result = await scenario.measure(bench)
            died = bench.stack.died()
            if died:  # a crash is a finding, not a slow variant: say so beside the figures
                result["processes_died"] = died
                print("\n".join(["!! processes died during the run:", *died]), file=sys.stderr)
            return result

    started = time.perf_counter()
    result: dict[str, Any] = {}
    forget_held_with_room()
    if scenario.in_process is not None:
        result["in_process"] = scenario.in_process(bench)
        progress("")
    if scenario.measure is not None:
        result.update(trio.run(measure))
    return {
        "scenario": scenario.name,
        "reproduces": scenario.reproduces,
        **provenance(),
        "quick": bool(args.quick),
        "seconds": round(time.perf_counter() - started, 1),
        # Issue 40: every Sluice of the run, asked at its stop how long it held requests while
        # an engine reported room.
        "held_with_room": held_with_room(),
        "result": result,
    }


def run(scenario: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    """Measure, write the JSON (and PNG), print the report; returns the blob."""
    blob = measured(scenario, args)
    path = write(scenario.name, blob, args.out_dir)
    print(report(scenario, blob))
    png = png_beside(path) if scenario.plot is not None else None
    if scenario.plot is not None and png is not None:
        scenario.plot(blob["result"], png)
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return blob
