"""Admission end to end: a real Sluice with its default flags in front of simulated GPUs on
127.0.0.1, whose own /metrics say when they are saturated.

- An engine with room for many gets them all at once: no fixed cap per backend (the old 128).
- An engine with room for two: what it cannot start waits at the proxy, and a light API key
  beside a heavy one leaves the queue before the heavy key's backlog (its requests wait a
  fraction of the heavy key's), as the request log's `queue_ms`, the snapshot's per-key
  shares and `sluice_admission_*` in /metrics show.
- A request's own `priority` (vLLM's field) leaves before the lower bands, never above its
  key's; a client's deadline header ends its wait with 429 and Retry-After.
- What is Sluice's own is known at once: a stream counts as started when its first token
  passes the relay; the room and the time held while the engine reported room are in
  /metrics.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import httpx
import trio

from app.preprocess.accounting import fingerprint
from tests.conftest import StartSim, StartSluice, wait_until


def body(tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": tokens,
        "stream": True,
        **extra,
    }


def key(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer sk-{name}"}


async def stream(client: httpx.AsyncClient, url: str, payload: dict[str, Any], **kw: Any) -> int:
    async with client.stream("POST", url + "/v1/chat/completions", json=payload, **kw) as answer:
        async for _ in answer.aiter_bytes():
            pass
        return answer.status_code


async def snapshot(client: httpx.AsyncClient, dashboard_url: str) -> dict[str, Any]:
    answer = await client.get(dashboard_url + "/api/snapshot")
    assert answer.status_code == 200
    result: dict[str, Any] = answer.json()
    return result


async def test_a_stream_starts_when_its_first_token_passes_and_metrics_say_the_room(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(max_num_seqs=1, inter_token_latency=0.05, metrics_style="sglang")
    running = await start_sluice([sim.url])
    backend = running.sluice.pool.backends[0]
    payload = body(200)
    async with (
        trio.open_nursery() as nursery,
        client.stream("POST", running.proxy_url + "/v1/chat/completions", json=payload) as answer,
    ):
        chunks = answer.aiter_bytes()  # kept: a dropped iterator closes the stream
        assert b"data:" in await chunks.__anext__()
        assert (backend.inflight, backend.unstarted) == (1, 0)  # it runs: started

        async def queued_behind() -> None:
            assert await stream(client, running.proxy_url, body(2)) == 200

        nursery.start_soon(queued_behind)

        async def waits_at_the_engine() -> bool:
            return sim.app.engine.waiting == 1

        await wait_until(waits_at_the_engine)
        assert (backend.inflight, backend.unstarted) == (2, 1)  # sent, no first byte
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    url = backend.url
    assert f'sluice_backend_room{{backend="{url}",basis="stated"}} 1.0' in metrics
    assert f'sluice_admission_held_with_room_seconds_total{{backend="{url}"}}' not in metrics


async def test_an_engine_with_room_gets_every_request_at_once(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    # Slow tokens: all 160 are running at once however slowly they arrive.
    sim = await start_sim(max_num_seqs=1024, inter_token_latency=0.5)
    running = await start_sluice([sim.url], max_connections=1024)
    limits = httpx.Limits(max_connections=400)
    async with httpx.AsyncClient(timeout=60, limits=limits, trust_env=False) as many:

        async def one() -> None:
            assert await stream(many, running.proxy_url, body(60)) == 200

        async with trio.open_nursery() as nursery:
            for _ in range(160):
                nursery.start_soon(one)

            async def all_at_the_engine() -> bool:
                # At the engine, none held at the proxy (the engine's own batch budget may keep
                # a few waiting for their prefill a step or two).
                engine = sim.app.engine
                return engine.running + engine.waiting == 160

            await wait_until(all_at_the_engine, timeout=30)
            assert running.sluice.router.gate.held == 0
            nursery.cancel_scope.cancel()


async def test_a_light_key_leaves_the_queue_before_a_heavy_keys_backlog(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(max_num_seqs=2, inter_token_latency=0.01)
    running = await start_sluice([sim.url], admission_timeout=60)
    light_waits: list[float] = []
    heavy_waits: list[float] = []
    done = trio.Event()

    async def client_loop(name: str, waits: list[float]) -> None:
        while not done.is_set():
            async with client.stream(
                "POST", running.proxy_url + "/v1/chat/completions", json=body(20), headers=key(name)
            ) as answer:
                timing = answer.headers.get("server-timing", "")
                async for _ in answer.aiter_bytes():
                    pass
            assert answer.status_code == 200
            queue = [part for part in timing.split(", ") if part.startswith("queue;dur=")]
            waits.append(float(queue[0].split("=")[1]))

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(client_loop, "heavy", heavy_waits)
        nursery.start_soon(client_loop, "light", light_waits)

        async def enough() -> bool:
            return len(light_waits) >= 12 and len(heavy_waits) >= 24

        await wait_until(enough, timeout=120)
        done.set()
    # The first requests went straight to the engine, before its queue was seen: past them,
    # the light key waits for the next free sequence, the heavy key behind its own backlog.
    light, heavy = light_waits[4:], heavy_waits[16:]
    assert statistics.median(light) * 3 < statistics.median(heavy)
    snap = await snapshot(client, running.dashboard_url)
    keys = snap["admission"]["models"]["m"]["keys"]
    assert {"key-" in name for name in keys} == {True}
    light_key = keys[fingerprint(b"sk-light")]
    assert light_key["left"] >= 0.9 * light_key["fair_left"]
    assert snap["backends"][0]["engine"]["waiting"] is not None
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert "sluice_admission_wait_seconds_count" in metrics
    assert 'sluice_admission_dispatched_total{api_key="' in metrics


async def test_priority_and_a_clients_deadline(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(max_num_seqs=1, inter_token_latency=0.02)
    # Queued at the engine, a stream has its head and no token for seconds.
    running = await start_sluice([sim.url], idle_timeout=30)
    gate = running.sluice.router.gate
    order: list[str] = []

    async def send(name: str, tokens: int = 10, **extra: Any) -> None:
        answer = body(tokens, **extra)
        status = await stream(client, running.proxy_url, answer, headers=key(name))
        assert status == 200
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, "first")

        async def engine_full() -> bool:  # the engine has said, twice, that its room is one
            backend = running.sluice.pool.backends[0]
            return backend.room.room == 1 or gate.saturated(backend) is not None

        for _ in range(3):
            nursery.start_soon(send, "filler", 60)  # a queue over several reports
        await wait_until(engine_full, timeout=10)

        async def held(count: int) -> bool:
            return gate.held >= count

        nursery.start_soon(functools.partial(send, "low", priority=5))
        await wait_until(lambda: held(1), timeout=10)
        nursery.start_soon(functools.partial(send, "urgent", priority=-5))
        await wait_until(lambda: held(2), timeout=10)
        late = await client.post(
            running.proxy_url + "/v1/chat/completions",
            json=body(10, stream=False),
            headers={**key("hurried"), "x-request-timeout": "0.2"},
        )
        assert late.status_code == 429 and late.json()["error"]["code"] == "queue_timeout"
        assert int(late.headers["retry-after"]) >= 1
    assert order.index("urgent") < order.index("low")
