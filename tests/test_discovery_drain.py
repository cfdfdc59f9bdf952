"""Drain, never drop, end to end: a real Sluice in front of simulated backends. A source's
sighting adds an engine (health-checked at once) and one that no longer lists an engine
drains it: no new request goes there, its streams in flight end with `[DONE]`, its
prefix-index entries go, the dashboard shows it draining until its last request ended, and
`/metrics` counts each change. The operator's `DELETE /api/backends` drains the same way;
a drain that outlasts `--drain-timeout` is counted as timed out."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from app.fleet.discoverer import SourceReport, SourceStatus
from app.fleet.discovery import Endpoint
from tests.conftest import RunningSluice, StartSim, StartSluice, wait_until

SLOW = {"inter_token_latency": 0.02}


def body(n: int, max_tokens: int = 30) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"question {n}: tell me more"}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def stream(client: httpx.AsyncClient, url: str, n: int, into: list[tuple[str, str]]) -> None:
    """One streamed chat: (the backend that served it, its last data line)."""
    async with client.stream("POST", url + "/v1/chat/completions", json=body(n)) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line.startswith("data:")]
        into.append((response.headers["x-sluice-backend"], lines[-1]))


def hand_source(running: RunningSluice, name: str = "dns:engines.test:8000") -> SourceReport:
    discoverer = running.sluice.discoverer
    assert discoverer is not None
    return SourceReport(discoverer, SourceStatus(name))


async def backends(client: httpx.AsyncClient, running: RunningSluice) -> list[dict[str, Any]]:
    snapshot = (await client.get(running.dashboard_url + "/api/snapshot")).json()
    rows: list[dict[str, Any]] = snapshot["backends"]
    return rows


async def metrics(client: httpx.AsyncClient, running: RunningSluice) -> str:
    return (await client.get(running.proxy_url + "/metrics")).text


async def test_an_engine_that_leaves_finishes_its_streams_and_takes_no_new_request(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    static, leaving, coming = [await start_sim(seed=n, **SLOW) for n in (1, 2, 3)]
    running = await start_sluice([static.url], admin_token="t")
    source = hand_source(running)
    source.sighting([Endpoint(leaving.url)])

    async def joined() -> bool:
        rows = await backends(client, running)
        return any(r["url"] == leaving.url and r["takes_traffic"] for r in rows)

    await wait_until(joined)
    row = next(r for r in await backends(client, running) if r["url"] == leaving.url)
    assert row["source"] == "dns:engines.test:8000" and row["joined_ago"] >= 0
    auth = {"authorization": "Bearer t"}
    static_id = next(r["id"] for r in await backends(client, running) if r["url"] == static.url)
    gone = await client.delete(f"{running.dashboard_url}/api/backends/{static_id}", headers=auth)
    assert gone.status_code == 200 and gone.json()["removed"]["url"] == static.url

    done: list[tuple[str, str]] = []
    async with trio.open_nursery() as nursery:
        for n in range(6):
            nursery.start_soon(stream, client, running.proxy_url, n, done)
        pool = running.sluice.pool
        await wait_until(lambda: _true(sum(b.inflight for b in pool.backends) == 6))
        source.sighting([Endpoint(coming.url)])  # `leaving` is gone from the answer
        rows = await backends(client, running)
        draining = next(r for r in rows if r["url"] == leaving.url)
        assert draining["draining_for"] is not None and not draining["takes_traffic"]
        assert draining["inflight"] == 6

        async def coming_serves() -> bool:
            return any(
                b.url == coming.url and b.takes_traffic(trio.current_time()) for b in pool.backends
            )

        await wait_until(coming_serves)
        after: list[tuple[str, str]] = []
        for n in range(6, 9):
            nursery.start_soon(stream, client, running.proxy_url, n, after)
    assert [last for _, last in done] == ["data: [DONE]"] * 6
    assert {served for served, _ in done} == {leaving.url}
    assert {served for served, _ in after} == {coming.url}

    async def drained() -> bool:
        return all(r["url"] != leaving.url for r in await backends(client, running))

    await wait_until(drained)
    text = await metrics(client, running)
    assert (
        'sluice_discovery_changes_total{change="left",source="dns:engines.test:8000"} 1.0' in text
    )
    assert (
        'sluice_discovery_changes_total{change="joined",source="dns:engines.test:8000"} 2.0' in text
    )
    assert 'sluice_backend_drains_total{outcome="finished"} 2.0' in text
    assert 'sluice_discovery_endpoints{source="dns:engines.test:8000"} 1.0' in text
    index = (await client.get(running.dashboard_url + "/api/snapshot")).json()["routing"]
    assert set(index["cache_aware"]["index"]["by_backend"]) <= {
        r["id"] for r in await backends(client, running)
    }


async def test_a_drain_that_outlasts_its_timeout_is_counted_and_forgotten(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    slow, other = await start_sim(seed=1, inter_token_latency=0.2), await start_sim(seed=2)
    running = await start_sluice([other.url], drain_timeout=0.3)
    source = hand_source(running)
    source.sighting([Endpoint(slow.url)])
    pool = running.sluice.pool
    await wait_until(lambda: _true(all(b.healthy for b in pool.backends)))
    done: list[tuple[str, str]] = []
    async with trio.open_nursery() as nursery:
        for n in range(4):
            nursery.start_soon(stream, client, running.proxy_url, n, done)
        slow_backend = pool.find(slow.url)
        assert slow_backend is not None
        await wait_until(lambda: _true(slow_backend.inflight >= 1))
        source.sighting([])
        await wait_until(lambda: _true(pool.draining == []))
        assert slow_backend.inflight >= 1  # forgotten while its requests still ran
        text = await metrics(client, running)
        assert 'sluice_backend_drains_total{outcome="timed_out"} 1.0' in text
    # They were not cut: the engine answered them whole, past the proxy's waiting.
    assert [last for _, last in done] == ["data: [DONE]"] * 4


async def test_a_failed_lookup_keeps_what_was_seen(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    first, found = await start_sim(seed=1), await start_sim(seed=2)
    running = await start_sluice([first.url])
    source = hand_source(running)
    source.sighting([Endpoint(found.url)])
    source.failed("DNS server 127.0.0.1:5353 timed out")
    source.failed("DNS server 127.0.0.1:5353 timed out")
    assert running.sluice.pool.find(found.url) is not None
    text = await metrics(client, running)
    assert (
        'sluice_discovery_lookups_total{outcome="failed",source="dns:engines.test:8000"} 2.0'
        in text
    )
    assert source.status.failures == 2 and source.status.last_error
    json.dumps(source.status.__dict__)  # what the dashboard shows of it is plain data


async def _true(value: bool) -> bool:
    return value
