"""The dashboard's HTTP API against a running Sluice and a simulated backend: the snapshot's
schema, the request log (what it records, and that it never holds a prompt or a key), policy
validation (400), the admin token (401), cross-origin writes and foreign hosts (403), the
server-sent events (a snapshot at once and one a tick, the same bytes for every page, a
policy change pushed to open pages, pages counted and capped)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from app.observe.request_log import RequestRecord
from tests.conftest import RunningSluice, StartSim, StartSluice, StartSluiceOnASim, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
SERIES = (
    "lag_p50_ms",
    "lag_p99_ms",
    "stalls_per_s",
    "l0_hit_pct",
    "l1_hit_pct",
    "threads_busy",
    "queued",
    "saturated_waiting",
    "fallback_busy",
    "waited_per_s",
    "bailed_out_per_s",
    "requests_per_s",
    "errors_per_s",
)


def strict_json(text: str | bytes) -> Any:
    """JSON as a browser parses it: NaN and Infinity are errors."""

    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


async def snapshot(client: httpx.AsyncClient, running: RunningSluice) -> dict[str, Any]:
    response = await client.get(running.dashboard_url + "/api/snapshot")
    assert response.status_code == 200
    result: dict[str, Any] = strict_json(response.content)
    return result


async def logged(client: httpx.AsyncClient, running: RunningSluice, count: int) -> list[Any]:
    """The request log once it holds `count` records (the last byte leaves before it is
    recorded, so the client may see its answer first)."""

    async def enough() -> bool:
        return len((await snapshot(client, running))["requests"]["recent"]) >= count

    await wait_until(enough)
    recent: list[Any] = (await snapshot(client, running))["requests"]["recent"]
    return recent


@asynccontextmanager
async def page(client: httpx.AsyncClient, url: str) -> AsyncIterator[AsyncIterator[bytes]]:
    """An open `/api/events` stream, as the raw payload of each `data:` event."""
    async with client.stream("GET", url + "/api/events") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")

        async def payloads() -> AsyncIterator[bytes]:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    yield line[len("data: ") :].encode()

        yield payloads()


async def test_snapshot_schema(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    running = await start_sluice([sim.url])
    for stream in (False, True):
        response = await client.post(
            running.proxy_url + "/v1/chat/completions", json={**CHAT, "stream": stream}
        )
        assert response.status_code == 200
    recent = await logged(client, running, 2)
    data = await snapshot(client, running)

    assert {
        "time",
        "wall_time",
        "policy",
        "dashboard",
        "models",
        "backends",
        "preprocess",
        "loop",
        "tokenize",
        "requests",
        "series",
        "window",
    } <= set(data)
    assert data["dashboard"] == {
        "demo": False,
        "write_needs_token": False,
        "pages": 0,
        "tick_s": 1.0,
        "longest_tick_s": 5.0,  # a quiet proxy's
        "history_points": 180,
    }
    (model,) = data["models"]
    assert (model["name"], model["requests"]["total"]) == ("m", 2)
    assert model["pool"]["backends"] == [data["backends"][0]["id"]]
    # Every field but `worker`, which only a supervisor's merged log has, and `legs`, which
    # only a disaggregated model's requests have.
    assert set(recent[0]) == set(RequestRecord.__annotations__) - {"worker", "legs"}
    assert "disaggregation" not in model
    streamed, whole = recent  # newest first
    assert (streamed["stream"], whole["stream"]) == (True, False)
    for record in recent:
        assert record["status"] == 200 and not record["client_gone"]
        assert record["backend"] == sim.url and record["route"].startswith("cache_aware:")
        assert record["model"] == "m" and record["kind"] == "chat"
        assert record["prompt_tokens"] > 0 and record["tokenize_path"] in (
            "inline",
            "thread",
            "l0",
            "l1",
        )
        assert 0 < record["ttft_ms"] <= record["duration_ms"]
    assert [r["seq"] for r in recent] == [2, 1]
    requests = data["requests"]
    assert requests["total"] == 2 and requests["by_class"] == {"2xx": 2}
    assert requests["capacity"] == 200

    traffic = data["backends"][0]["traffic"]
    assert traffic["requests_total"] == 2 and traffic["errors_total"] == 0
    assert traffic["codes"] == {"200": 2}
    assert traffic["ttft_samples"] == 2 and 0 < traffic["ttft_p50_s"] <= traffic["ttft_p99_s"]
    assert sum(traffic["route_reasons"].values()) == 2
    assert {"requests_per_s", "errors_per_s", "answered"} <= set(traffic)

    tokenize = data["tokenize"]
    assert set(tokenize["saturated"]) == {"waited", "bailed_out"}
    summary = next(iter(tokenize["latency_by_path"].values()))
    assert {"buckets", "count", "sum", "p50", "p99"} <= set(summary)
    assert tokenize["template"]["count"] == 2

    series = data["series"]
    assert "t" in series
    assert all(len(column) == len(series["t"]) for column in series.values())
    window = data["window"]
    assert set(window) == {"seconds", "lag", "stalls", "tokenize"}
    assert {"l0_hit_pct", "l1_hit_pct"} <= set(model["caches"])

    # What a supervisor merges: the counts alone, nothing derived from this feed's window.
    response = await client.get(running.dashboard_url + "/api/snapshot?counters=1")
    counters = response.json()
    assert not {"series", "window", "dashboard"} & set(counters)
    (model,) = counters["models"]
    assert all(isinstance(n, int) for n in model["caches"].values())
    assert "per_s" not in counters["requests"]
    assert "requests_per_s" not in counters["backends"][0]["traffic"]


async def test_series_fill_in_once_a_tick(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    running = await start_sluice([sim.url])

    async def two_points() -> bool:
        return len((await snapshot(client, running))["series"]["t"]) >= 2

    await wait_until(two_points, timeout=5)
    series = (await snapshot(client, running))["series"]
    assert set(SERIES) <= set(series)
    assert f"backend_rps:{sim.url}" in series
    assert series["t"] == sorted(series["t"])


async def test_request_log_never_holds_a_prompt_or_a_key(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim()
    secret_prompt = "SECRET-PROMPT-4f1d"
    secret_key = "sk-SECRET-KEY-9a7c"
    body = {**CHAT, "messages": [{"role": "user", "content": secret_prompt}]}
    headers = {"authorization": f"Bearer {secret_key}", "x-request-id": "r" * 500}
    ok = await client.post(running.proxy_url + "/v1/chat/completions", json=body, headers=headers)
    assert ok.status_code == 200
    bad = await client.post(running.proxy_url + "/v1/chat/completions", json={"model": "m"})
    assert bad.status_code == 400
    refused, answered = await logged(client, running, 2)
    text = (await client.get(running.dashboard_url + "/api/snapshot")).text
    assert secret_prompt not in text and secret_key not in text
    assert len(answered["id"]) < 100  # a client-chosen request id is clipped
    assert refused["status"] == 400 and refused["backend"] is None
    assert refused["prompt_tokens"] is None and not refused["client_gone"]


async def test_a_client_that_leaves_mid_stream_is_logged_as_gone(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(inter_token_latency=0.05)
    running = await start_sluice([sim.url])
    body = {**CHAT, "stream": True, "max_tokens": 200}
    async with client.stream("POST", running.proxy_url + "/v1/chat/completions", json=body) as r:
        async for _ in r.aiter_raw():
            break
    (record,) = await logged(client, running, 1)
    assert record["client_gone"] and record["status"] == 200


@pytest.mark.parametrize(
    "content",
    [b"not json", b"[1, 2]", b'{"saturation": "drop"}', b'{"saturation": "wait", "x": 1}', b"{}"],
    ids=["not-json", "array", "bad-value", "unknown-field", "missing"],
)
async def test_bad_policy_values_get_400(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient, content: bytes
) -> None:
    running = await start_sluice_on_a_sim()
    response = await client.put(running.dashboard_url + "/api/policy", content=content)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert running.sluice.preprocessor.saturation == "wait"


async def test_oversized_and_unknown_requests_get_json_errors(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim()
    big = await client.put(running.dashboard_url + "/api/policy", content=b"{" + b" " * 100_000)
    assert big.status_code == 413 and "error" in big.json()
    missing = await client.get(running.dashboard_url + "/api/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    burst = await client.post(running.dashboard_url + "/api/demo/burst")
    assert burst.status_code == 404  # only `sluice demo` has bursts
    wrong_method = await client.post(running.dashboard_url + "/api/policy")
    assert wrong_method.status_code == 405 and "PUT" in wrong_method.headers["allow"]
    assert "error" in wrong_method.json()


async def test_writes_need_the_admin_token(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim(admin_token="s3cret")
    url = running.dashboard_url + "/api/policy"
    body = {"saturation": "bail-out"}
    assert (await client.put(url, json=body)).status_code == 401
    wrong = await client.put(url, json=body, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert running.sluice.preprocessor.saturation == "wait"
    right = await client.put(url, json=body, headers={"authorization": "Bearer s3cret"})
    assert right.status_code == 200 and right.json() == {"saturation": "bail-out"}
    assert (await snapshot(client, running))["dashboard"]["write_needs_token"] is True
    # Reads stay open: the page itself must load without a token.
    assert (await client.get(running.dashboard_url + "/")).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "https://evil.example"},
        {"origin": "http://127.0.0.1:1"},
        {"origin": "null"},
        {"sec-fetch-site": "cross-site"},
    ],
    ids=["other-site", "other-port", "opaque", "fetch-metadata"],
)
async def test_cross_origin_writes_are_refused(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient, headers: Any
) -> None:
    running = await start_sluice_on_a_sim(admin_token="s3cret")
    auth = {"authorization": "Bearer s3cret"}
    url = running.dashboard_url + "/api/policy"
    refused = await client.put(url, json={"saturation": "bail-out"}, headers={**auth, **headers})
    assert refused.status_code == 403 and "cross-origin" in refused.json()["error"]["message"]
    assert running.sluice.preprocessor.saturation == "wait"
    same = {"origin": running.dashboard_url, "sec-fetch-site": "same-origin", **auth}
    assert (await client.put(url, json={"saturation": "bail-out"}, headers=same)).status_code == 200


async def test_foreign_host_names_are_refused_on_loopback(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim()
    rebound = await client.get(
        running.dashboard_url + "/api/snapshot", headers={"host": "evil.example"}
    )
    assert rebound.status_code == 403
    page_html = await client.get(running.dashboard_url + "/")
    assert "frame-ancestors 'none'" in page_html.headers["content-security-policy"]
    assert 'id="saturation-switch"' in page_html.text


async def test_events_deliver_snapshots_the_same_bytes_to_every_page(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim()
    seen: list[list[bytes]] = [[], []]

    async def read(index: int) -> None:
        async with page(client, running.dashboard_url) as payloads:
            async for payload in payloads:
                seen[index].append(payload)
                if len(seen[index]) == 3:
                    return

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, 0)
            nursery.start_soon(read, 1)
    first, second = seen
    shared = set(first) & set(second)
    assert len(shared) >= 2  # every tick after both joined: one payload, sent to both
    snapshots = [strict_json(p) for p in first]
    assert all(s["preprocess"]["saturation"] == "wait" for s in snapshots)
    assert max(s["dashboard"]["pages"] for s in snapshots) == 2
    assert [s["wall_time"] for s in snapshots] == sorted(s["wall_time"] for s in snapshots)

    async def no_pages() -> bool:
        return (await snapshot(client, running))["dashboard"]["pages"] == 0

    await wait_until(no_pages)


async def test_a_policy_change_reaches_open_pages_at_once(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim()
    async with page(client, running.dashboard_url) as payloads:
        first = strict_json(await payloads.__anext__())
        assert first["preprocess"]["saturation"] == "wait"
        put = await client.put(
            running.dashboard_url + "/api/policy", json={"saturation": "bail-out"}
        )
        assert put.status_code == 200
        # The write publishes at once (one tick's event may already have been on its way).
        with trio.fail_after(5):
            async for payload in payloads:
                if strict_json(payload)["preprocess"]["saturation"] == "bail-out":
                    break
    assert (await snapshot(client, running))["preprocess"]["saturation"] == "bail-out"
    assert running.sluice.preprocessor.saturation == "bail-out"


async def test_pages_are_capped(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim()
    feed = running.sluice.dashboard_feed
    assert feed is not None
    feed.max_pages = 1
    async with page(client, running.dashboard_url) as payloads:
        await payloads.__anext__()
        refused = await client.get(running.dashboard_url + "/api/events")
        assert refused.status_code == 503 and "error" in refused.json()
