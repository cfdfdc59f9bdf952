"""DNS discovery (`--discover-dns`) against a real DNS server, Debian's dnsmasq started on a
free port (load/dnsmasq.py), and simulated engines on several loopback addresses.

Covered: the lookup schedule (interval, TTL, floor, back-off: plain numbers); A/AAAA records
as engines on the flag's port (IPv6 in brackets), SRV records with each one's port; a name
that does not exist lists no engines, a REFUSED or unanswered lookup is a failure; lookups
run on Trio's sockets (no thread, the loop never stalls on a dead server); a record's TTL
shorter than the interval brings the next lookup forward. End to end, a Sluice under
streamed traffic: a record added -> the engine takes requests within an interval + 1 s of
the change; a record removed -> it takes no new request, its streams end with [DONE], none
lost; dnsmasq stopped -> the engines stay and failed lookups are counted, restarted -> changes
are followed again; SRV engines (one on ::1) serve.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import dns.message
import dns.rrset
import pytest
import trio

from app.discovery_targets import DnsServer, DnsTarget
from app.fleet.dns_schedule import FIRST_RETRY_S, TTL_FLOOR_S, LookupSchedule, engine_url
from app.fleet.dns_source import DnsSource, negative_ttl
from load import harness
from load.client import CHAT, Connection, Pool, Prepared, encode
from load.dnsmasq import DNSMASQ, Dnsmasq
from load.drive import Record, send
from tests.conftest import MODEL, RunningSluice, StartSim, StartSluice, wait_until

if not os.path.exists(DNSMASQ):
    if os.environ.get("CI"):
        raise RuntimeError(f"CI needs {DNSMASQ} (.ci/run installs dnsmasq-base)")
    pytest.skip(f"needs {DNSMASQ} (apt-get install -y dnsmasq-base)", allow_module_level=True)

INTERVAL = 1.0
NAME = "engines.test"
# Streams of ~0.5 s (25 tokens, 20 ms apart): several are in flight whenever a record changes.
STREAMING_SIM = {"inter_token_latency": 0.02, "max_num_seqs": 64}


class Recorded:
    """What a source reported, in order."""

    def __init__(self) -> None:
        self.sightings: list[set[str]] = []
        self.failures: list[str] = []
        self.changed = trio.Event()

    def sighting(self, endpoints: Any) -> None:
        self.sightings.append({endpoint.url for endpoint in endpoints})
        self._wake()

    def failed(self, why: str) -> None:
        self.failures.append(why)
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


@pytest.fixture
async def dnsmasq(tmp_path: Path) -> AsyncIterator[Dnsmasq]:
    server = Dnsmasq(tmp_path)
    await server.start()
    yield server
    server.stop()


def source(dnsmasq: Dnsmasq, target: str, interval: float = INTERVAL) -> DnsSource:
    return DnsSource(DnsTarget.parse(target), DnsServer("127.0.0.1", dnsmasq.port), interval)


def test_a_lookup_follows_the_interval_or_a_shorter_ttl() -> None:
    schedule = LookupSchedule(interval=5.0)
    assert schedule.after_answer(None) == 5.0  # a negative answer without SOA
    assert schedule.after_answer(0) == 5.0  # "do not cache": the interval
    assert schedule.after_answer(3) == 3.0
    assert schedule.after_answer(300) == 5.0
    assert schedule.after_answer(0.2) == TTL_FLOOR_S  # never a spinning loop
    assert LookupSchedule(interval=0.5).after_answer(1) == 0.5  # the operator's interval holds


def test_failures_back_off_up_to_the_interval_and_an_answer_ends_it() -> None:
    schedule = LookupSchedule(interval=5.0)
    delays = [schedule.after_failure() for _ in range(7)]
    assert delays == [FIRST_RETRY_S * 2**n for n in range(5)] + [5.0, 5.0]
    assert schedule.after_answer(None) == 5.0
    assert schedule.after_failure() == FIRST_RETRY_S
    assert LookupSchedule(interval=0.1).after_failure() == 0.1
    assert LookupSchedule(interval=60).lookup_timeout == 5.0
    assert LookupSchedule(interval=0.1).lookup_timeout == TTL_FLOOR_S


def test_a_negative_answer_holds_for_its_soas_ttl_or_minimum_whichever_is_less() -> None:
    response = dns.message.make_response(dns.message.make_query(NAME, "A"))
    soa = "ns.test. admin.test. 1 3600 600 86400 {minimum}"
    for ttl, minimum in ((30, 10), (5, 60)):
        response.authority = [
            dns.rrset.from_text("test.", ttl, "IN", "SOA", soa.format(minimum=minimum))
        ]
        assert negative_ttl([response]) == min(ttl, minimum)
    response.authority = []
    assert negative_ttl([response]) is None


def test_engine_urls_write_ipv6_in_brackets() -> None:
    assert engine_url("10.0.0.7", 8000) == "http://10.0.0.7:8000"
    assert engine_url("fd00::7", 8000) == "http://[fd00::7]:8000"


async def test_a_and_aaaa_records_are_engines_on_the_port(tmp_path: Path) -> None:
    server = Dnsmasq(tmp_path, local_ttl=7)
    server.hosts = {NAME: ("127.0.0.2", "127.0.0.3", "::1")}
    await server.start()
    try:
        urls, ttl = await source(server, f"{NAME}:8000").look()
    finally:
        server.stop()
    assert urls == {"http://127.0.0.2:8000", "http://127.0.0.3:8000", "http://[::1]:8000"}
    assert ttl == 7


async def test_srv_records_name_each_engine_and_its_port(dnsmasq: Dnsmasq) -> None:
    await dnsmasq.set_hosts({"a.test": ["127.0.0.2"], "b.test": ["127.0.0.3", "::1"]})
    await dnsmasq.set_services(
        [("_http._tcp.engines.test", "a.test", 8001), ("_http._tcp.engines.test", "b.test", 8002)]
    )
    urls, _ = await source(dnsmasq, "_http._tcp.engines.test").look()
    assert urls == {"http://127.0.0.2:8001", "http://127.0.0.3:8002", "http://[::1]:8002"}


async def test_no_such_name_lists_no_engines_but_a_refusal_is_a_failure(
    dnsmasq: Dnsmasq, nursery: trio.Nursery
) -> None:
    assert await source(dnsmasq, "gone.test:8000").look() == (set(), None)
    report = Recorded()
    nursery.start_soon(source(dnsmasq, "elsewhere.example:8000").run, report)
    await report.changed.wait()
    assert report.sightings == []
    assert "REFUSED" in report.failures[0]


async def test_a_dead_server_fails_on_trios_sockets_without_a_thread_or_a_stall(
    nursery: trio.Nursery,
) -> None:
    # A UDP socket that never answers: the lookup waits on Trio's own I/O until its timeout.
    silent = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await silent.bind(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    dead = DnsSource(DnsTarget.parse(f"{NAME}:8000"), DnsServer("127.0.0.1", port), INTERVAL)
    threads = threading.active_count()
    report = Recorded()
    worst_gap = 0.0

    async def tick() -> None:
        nonlocal worst_gap
        last = trio.current_time()
        while True:
            await trio.sleep(0.005)
            now = trio.current_time()
            worst_gap, last = max(worst_gap, now - last), now

    nursery.start_soon(tick)
    began = trio.current_time()
    nursery.start_soon(dead.run, report)
    await report.changed.wait()
    took = trio.current_time() - began
    assert report.failures and not report.sightings
    assert took >= dead.schedule.lookup_timeout * 0.9
    assert threading.active_count() == threads
    assert worst_gap < took / 10  # the loop kept turning while the lookup waited
    silent.close()


async def test_a_ttl_shorter_than_the_interval_brings_the_next_lookup_forward(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    server = Dnsmasq(tmp_path, local_ttl=1)
    server.hosts = {NAME: ("127.0.0.2",)}
    await server.start()
    report = Recorded()
    nursery.start_soon(source(server, f"{NAME}:8000", interval=60).run, report)
    try:
        while not report.sightings:
            await report.changed.wait()
        changed_at = trio.current_time()
        await server.set_hosts({NAME: ["127.0.0.3"]})
        while report.sightings[-1] != {"http://127.0.0.3:8000"}:
            await report.changed.wait()
        assert trio.current_time() - changed_at <= 1 + 1.0  # the TTL, not the 60 s interval
    finally:
        server.stop()


# End to end: a Sluice following the name under streamed traffic.


def stream(netloc: str, tokens: int) -> Prepared:
    """A streamed chat of `tokens` tokens (20 ms apart on STREAMING_SIM's engines)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    data = json.dumps({**body, "max_tokens": tokens}).encode()
    return Prepared("stream", True, encode(netloc, "POST", CHAT, data))


async def traffic(proxy: str, records: list[Record], workers: int = 4) -> None:
    """Streams of ~0.5 s, `workers` at a time, until cancelled; each outcome recorded, its
    `start` a `time.perf_counter()`."""
    async with Pool(proxy, timeout=30.0) as pool:
        request = stream(pool.netloc, 25)

        async def worker() -> None:
            while True:
                records.append(await send(pool, request, 0.0))

        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(worker)


async def body_to_end(connection: Connection) -> bytes:
    chunks = []
    while (chunk := await connection.read_chunk()) is not None:
        chunks.append(chunk)
    return b"".join(chunks)


def in_pool(running: RunningSluice) -> set[str]:
    return {backend.url for backend in running.sluice.router.pool.backends}


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async def holds() -> bool:
        return condition()

    await wait_until(holds, timeout)


def counted(samples: dict[str, float], name: str, **labels: str) -> float:
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(
        value
        for key, value in samples.items()
        if key.startswith(name + "{") and all(label in key for label in wanted)
    )


async def test_engines_join_and_leave_as_records_change_under_streamed_traffic(
    dnsmasq: Dnsmasq, start_sim: StartSim, start_sluice: StartSluice, nursery: trio.Nursery
) -> None:
    first = await start_sim(host="127.0.0.2", **STREAMING_SIM)
    port = first.port
    second = await start_sim(host="127.0.0.3", port=port, **STREAMING_SIM)
    third = await start_sim(host="127.0.0.4", port=port, **STREAMING_SIM)
    await dnsmasq.set_hosts({NAME: ["127.0.0.2", "127.0.0.3"]})
    target = f"{NAME}:{port}"
    running = await start_sluice(
        [], discover_dns=(target,), dns_server=dnsmasq.server, discover_interval=INTERVAL
    )
    await until(lambda: in_pool(running) == {first.url, second.url})
    records: list[Record] = []
    nursery.start_soon(traffic, running.proxy_url, records)

    changed_at = trio.current_time()
    await dnsmasq.set_hosts({NAME: ["127.0.0.2", "127.0.0.3", "127.0.0.4"]})
    await until(lambda: third.app.engine.prompt_tokens_total > 0, timeout=10)
    assert trio.current_time() - changed_at <= INTERVAL + 1.0

    # Long streams (~4 s) until one runs on the engine about to leave: it is in flight as the
    # engine drains, and must still end with [DONE].
    async with Pool(running.proxy_url, timeout=30.0) as pool:
        opened: list[tuple[str, Connection]] = []
        with trio.fail_after(10):
            while not any(backend == first.url for backend, _ in opened):
                connection = await pool.start(stream(pool.netloc, 200).data)
                opened.append((connection.headers["x-sluice-backend"], connection))
        await dnsmasq.set_hosts({NAME: ["127.0.0.3", "127.0.0.4"]})
        await until(lambda: first.url not in in_pool(running), timeout=10)
        left_at = time.perf_counter()
        assert first.app.engine.running > 0  # still streaming while it drains
        for _, connection in opened:
            assert (await body_to_end(connection)).rstrip().endswith(b"data: [DONE]")

    settle = len(records) + 20
    await until(lambda: len(records) >= settle, timeout=20)
    sent_after = [r for r in records if r.start > left_at]
    assert sent_after and not [r for r in sent_after if r.backend == first.url]
    assert all(r.ok for r in records), {r.error for r in records}  # none lost
    assert {r.backend for r in records} == {first.url, second.url, third.url}

    samples = await harness.scrape(running.proxy_url)
    source_label = f"dns:{target}"
    changes = "sluice_discovery_changes_total"
    assert counted(samples, changes, source=source_label, change="joined") == 3
    assert counted(samples, changes, source=source_label, change="left") == 1
    assert counted(samples, "sluice_discovery_endpoints", source=source_label) == 2


async def test_a_stopped_dns_server_keeps_the_engines_and_a_restarted_one_is_followed(
    dnsmasq: Dnsmasq, start_sim: StartSim, start_sluice: StartSluice, nursery: trio.Nursery
) -> None:
    first = await start_sim(host="127.0.0.2", **STREAMING_SIM)
    second = await start_sim(host="127.0.0.3", port=first.port, **STREAMING_SIM)
    target = f"{NAME}:{first.port}"
    await dnsmasq.set_hosts({NAME: ["127.0.0.2"]})
    running = await start_sluice(
        [], discover_dns=(target,), dns_server=dnsmasq.server, discover_interval=INTERVAL
    )
    await until(lambda: in_pool(running) == {first.url})
    records: list[Record] = []
    nursery.start_soon(traffic, running.proxy_url, records, 2)

    async def failed_lookups() -> float:
        samples = await harness.scrape(running.proxy_url)
        return counted(samples, "sluice_discovery_lookups_total", outcome="failed")

    dnsmasq.stop()
    with trio.fail_after(10):
        while await failed_lookups() < 2:
            await trio.sleep(0.05)
    assert in_pool(running) == {first.url}
    served = len(records)
    await until(lambda: len(records) >= served + 5)

    dnsmasq.hosts = {NAME: ("127.0.0.2", "127.0.0.3")}
    await dnsmasq.start()
    await until(lambda: in_pool(running) == {first.url, second.url}, timeout=10)
    await until(lambda: second.app.engine.prompt_tokens_total > 0)
    assert all(r.ok for r in records), {r.error for r in records}


async def test_srv_engines_serve_one_on_ipv6(
    dnsmasq: Dnsmasq, start_sim: StartSim, start_sluice: StartSluice, client: Any
) -> None:
    v4 = await start_sim(host="127.0.0.2")
    v6 = await start_sim(host="::1")
    await dnsmasq.set_hosts({"a.test": ["127.0.0.2"], "b.test": ["::1"]})
    service = "_http._tcp.engines.test"
    await dnsmasq.set_services([(service, "a.test", v4.port), (service, "b.test", v6.port)])
    running = await start_sluice(
        [], discover_dns=(service,), dns_server=dnsmasq.server, discover_interval=INTERVAL
    )
    wanted = {f"http://127.0.0.2:{v4.port}", f"http://[::1]:{v6.port}"}
    await until(lambda: in_pool(running) == wanted)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    backends = set()
    for _ in range(8):
        response = await client.post(running.proxy_url + CHAT, json=body)
        assert response.status_code == 200
        backends.add(response.headers["x-sluice-backend"])
    assert backends == wanted
