"""`python -m load bench discovery [--part dns|k8s]`: engines that come and go under traffic,
as discovery finds them (issue 44). Each part is its own function and its own table; `k8s`
(a stand-in Kubernetes API server) is load/discovery_k8s.py's.

`dns`: a real DNS server (Debian's dnsmasq, load/dnsmasq.py) holds one name whose A records
are 4 simulated engines on 127.0.0.2-5, all on one port; `sluice serve --discover-dns
NAME:PORT --dns-server ... --discover-interval 2` follows it while an open loop sends 50
streams a second (Poisson, ~1 s each: 20 tokens 50 ms apart). A third of the way in, a 5th
record (127.0.0.6) is added; two thirds in, the first record is removed. Reported: the time
from the change (the hosts file rewritten, before dnsmasq's SIGHUP) to the new engine's first
request, and to the removed engine leaving the pool (`sluice_discovery_changes_total`,
polled every 50 ms); the streams the leaving engine had in flight then and how they ended;
requests sent to it after it left; requests lost; each engine's share. Checked: first
request <= interval + 1 s after the change; 0 lost; every stream in flight on the leaving
engine ended with [DONE]; none sent to it after it left.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from load import drive, harness
from load.arrivals import schedule
from load.client import CHAT, Pool, Prepared, encode
from load.discovery_k8s import k8s_table, k8s_targets, measure_k8s
from load.dnsmasq import Dnsmasq
from load.drive import Record
from load.harness import Bench, Scenario, Table
from load.processes import MODEL

NAME = "engines.test"
INTERVAL_S = 2.0
RATE = 50.0  # streams a second
ANSWER_TOKENS = 20
SIM_TIMING = ("--inter-token-latency", "0.05", "--max-num-seqs", "256")
FIRST = [f"127.0.0.{n}" for n in range(2, 6)]
ADDED = "127.0.0.6"
LEFT = "sluice_discovery_changes_total"
POLL_S = 0.05


def stream_plan(netloc: str, seconds: float) -> list[tuple[float, Prepared]]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the fleet."}],
        "max_tokens": ANSWER_TOKENS,
        "stream": True,
    }
    prepared = Prepared("stream", True, encode(netloc, "POST", CHAT, json.dumps(body).encode()))
    seed = random.Random("discovery/dns").randrange(1 << 30)
    return [(at, prepared) for at in schedule("poisson", RATE, seconds, seed)]


async def left_count(proxy: str, source: str) -> float:
    samples = await harness.scrape(proxy)
    return samples.get(f'{LEFT}{{change="left",source="{source}"}}', 0.0)


async def measure_dns(bench: Bench) -> dict[str, Any]:
    seconds = bench.pick(15.0, 30.0)
    with tempfile.TemporaryDirectory(prefix="sluice-dns-") as directory:
        dnsmasq = Dnsmasq(Path(directory))
        dnsmasq.hosts = {NAME: tuple(FIRST)}
        await dnsmasq.start()
        try:
            return await _dns_run(bench, dnsmasq, seconds)
        finally:
            dnsmasq.stop()


async def _dns_run(bench: Bench, dnsmasq: Dnsmasq, seconds: float) -> dict[str, Any]:
    stack = bench.stack
    first = await stack.sim("--host", FIRST[0], *SIM_TIMING)
    port = first.rsplit(":", 1)[1]
    engines = [first] + [
        await stack.sim("--host", address, "--port", port, *SIM_TIMING)
        for address in (*FIRST[1:], ADDED)
    ]
    target, source = f"{NAME}:{port}", f"dns:{NAME}:{port}"
    proxy = await stack.proxy(
        [], "--discover-dns", target, "--dns-server", dnsmasq.server,
        "--discover-interval", str(INTERVAL_S),
    )  # fmt: skip
    with trio.fail_after(30):
        while harness.metric(await harness.scrape(proxy), "sluice_backend_healthy") != 4:
            await trio.sleep(POLL_S)
    leaving, added = engines[0], engines[-1]
    times: dict[str, float] = {}

    async def changes(start: float) -> None:
        await trio.sleep_until(trio.current_time() + seconds / 3)
        times["added"] = time.perf_counter() - start
        await dnsmasq.set_hosts({NAME: [*FIRST, ADDED]})
        await trio.sleep_until(trio.current_time() + seconds / 3)
        times["removed"] = time.perf_counter() - start
        await dnsmasq.set_hosts({NAME: [*FIRST[1:], ADDED]})
        with trio.move_on_after(seconds):
            while await left_count(proxy, source) < 1:
                await trio.sleep(POLL_S)
            times["left"] = time.perf_counter() - start

    start = time.perf_counter()
    async with Pool(proxy, timeout=60.0) as pool, trio.open_nursery() as nursery:
        nursery.start_soon(changes, start)
        run = await drive.open_loop(
            pool, stream_plan(pool.netloc, seconds), start=start, label="discovery dns"
        )
    final = await harness.scrape(proxy)
    return dns_result(run.records, times, run.seconds, final, leaving, added, source)


def dns_result(
    records: list[Record],
    times: dict[str, float],
    seconds: float,
    final: dict[str, float],
    leaving: str,
    added: str,
    source: str,
) -> dict[str, Any]:
    to_added = [r.start for r in records if r.backend == added]
    on_leaving = [r for r in records if r.backend == leaving]
    left = times.get("left")
    in_flight = [r for r in on_leaving if left is not None and r.start < left < r.start + _e2e(r)]
    lookups = harness.label_values(final, "sluice_discovery_lookups_total", "outcome")
    return {
        "seconds": round(seconds, 1),
        "rate": RATE,
        "interval_s": INTERVAL_S,
        "requests": len(records),
        "lost": sum(not r.ok for r in records),
        "error_kinds": sorted({r.error for r in records if r.error}),
        "first_request_s": min(to_added) - times["added"] if to_added else None,
        "left_after_s": None if left is None else left - times["removed"],
        "in_flight_at_leave": len(in_flight),
        "in_flight_done": sum(r.ok for r in in_flight),
        "sent_after_leave": sum(r.start > left for r in on_leaving) if left else None,
        "per_engine": dict(sorted(Counter(str(r.backend) for r in records).items())),
        "drains": harness.label_values(final, "sluice_backend_drains_total", "outcome"),
        "lookups": lookups,
        "endpoints_now": harness.label_values(final, "sluice_discovery_endpoints", "source").get(
            source
        ),
        "times": times,
    }


def _e2e(record: Record) -> float:
    return record.e2e or 0.0


def dns_targets(part: dict[str, Any]) -> list[str]:
    lines: list[str] = []

    def check(label: str, ok: bool) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'} dns: {label}")

    first, bound = part["first_request_s"], part["interval_s"] + 1.0
    check(
        f"a record added -> its engine's first request after {harness.fmt(first, 2)} s "
        f"<= interval + 1 s = {bound:g} s",
        first is not None and first <= bound,
    )
    check(f"0 requests lost ({part['lost']} of {part['requests']})", part["lost"] == 0)
    check(
        f"a record removed -> its {part['in_flight_at_leave']} streams in flight ended with "
        f"[DONE] ({part['in_flight_done']})",
        part["in_flight_at_leave"] > 0 and part["in_flight_done"] == part["in_flight_at_leave"],
    )
    check(
        f"no request sent to it after it left ({part['sent_after_leave']})",
        part["sent_after_leave"] == 0,
    )
    return lines


PARTS: dict[str, Callable[[Bench], Awaitable[dict[str, Any]]]] = {
    "dns": measure_dns,
    "k8s": lambda bench: measure_k8s(bench, stream_plan),
}
TARGETS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "dns": dns_targets,
    "k8s": k8s_targets,
}


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


def dns_table(part: dict[str, Any]) -> Table:
    per_engine = part["per_engine"].items()
    shares = ", ".join(f"{url.removeprefix('http://')} {n}" for url, n in per_engine)
    return Table(
        f"DNS: 4 engines behind one name (dnsmasq), {part['rate']:g} streams/s for "
        f"{part['seconds']:g} s, --discover-interval {part['interval_s']:g}; a 5th record added "
        "a third in, the first removed two thirds in; times from the change (s); in flight: "
        f"streams on the leaving engine as it left; requests per engine: {shares}",
        ["requests", "lost", "first request s", "left after s", "in flight", "ended [DONE]",
         "sent after leaving", "lookups ok / failed"],
        [[part["requests"], part["lost"], part["first_request_s"], part["left_after_s"],
          part["in_flight_at_leave"], part["in_flight_done"], part["sent_after_leave"],
          f"{part['lookups'].get('ok', 0):.0f} / {part['lookups'].get('failed', 0):.0f}"]],
        digits=2,
    )  # fmt: skip


TABLES: dict[str, Callable[[dict[str, Any]], Table]] = {"dns": dns_table, "k8s": k8s_table}


def tables(result: dict[str, Any]) -> list[Table]:
    found = [TABLES[name](part) for name, part in result["parts"].items()]
    return [*found, Table("", ["target"], [[line] for line in result["targets"]])]


SCENARIO = Scenario(
    name="discovery",
    reproduces="issue 44",
    about="engines found by DNS or a Kubernetes watch come and go under streamed traffic: "
    "joins, drains, none lost",
    reference=(
        "Issue 44's targets: DNS: 4 engines behind one name at 50 streams/s; a record added\n"
        "-> its engine takes traffic within one interval + 1 s; a record removed -> 0 lost,\n"
        "its in-flight streams end with [DONE]. Kubernetes stand-in: a rolling replacement\n"
        "of 8 pods (one at a time, Ready after a delay) under 50 req/s -> 0 lost, no request\n"
        "sent to a pod not Ready; a watch cut mid-stream and a 410 Gone -> relist, nothing\n"
        "missed; 1,000 pods listed -> discovery's CPU reported, the loop's worst stall < 10 ms."
    ),
    measure=measure,
    tables=tables,
    options=options,
)
