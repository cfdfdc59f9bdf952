"""Backends failing under the proxy: a killed backend costs no request, all backends down
gives a fast OpenAI error and recovery follows, a client that disconnects mid-stream, or
before a non-streamed answer, frees the backend's slot, a stream that breaks ends with an
SSE error event, timeouts are 504, backends without /health are probed on /v1/models, and
shutdown drains in-flight streams."""

from __future__ import annotations

import json

import httpx
import trio

from app.fleet.backends import Backend
from app.http.exchange import Exchange
from tests.conftest import SimHandle, StartBackend, StartSim, StartSluice, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def wait_until_freed(client: httpx.AsyncClient, sim: SimHandle, backend: Backend) -> None:
    """Until the proxy counts nothing in flight to `backend` and the engine runs nothing."""

    async def freed() -> bool:
        state = (await client.get(sim.url + "/sim/state")).json()
        return backend.inflight == 0 and state["running"] == 0

    await wait_until(freed)


async def test_killed_backend_costs_no_request(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sims = [await start_sim(seed=i) for i in range(3)]
    # A slow health check: the proxy must survive on retries before it notices.
    running = await start_sluice([s.url for s in sims], health_check_interval=60)
    for _ in range(6):
        assert (await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)).is_success
    sims[0].kill()
    backends = set()
    for _ in range(20):
        response = await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        backends.add(response.headers["x-sluice-backend"])
    assert sims[0].url not in backends
    assert len(backends) == 2


async def test_all_backends_down_then_recovery(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sims = [await start_sim(seed=i) for i in range(2)]
    running = await start_sluice([s.url for s in sims])
    for sim in sims:
        sim.kill()
    with trio.fail_after(10):
        response = await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)
    assert response.status_code in (502, 503)
    assert response.json()["error"]["message"]

    async def health_is_503() -> bool:
        return (await client.get(running.proxy_url + "/health")).status_code == 503

    await wait_until(health_is_503)
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    assert response.headers["retry-after"]
    assert response.json()["error"]["code"] == "no_healthy_backend"

    revived = await start_sim(port=sims[1].port)

    async def serves_again() -> bool:
        r = await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)
        return r.status_code == 200

    await wait_until(serves_again)
    assert revived.url == sims[1].url


async def test_client_disconnect_mid_stream_frees_the_backend(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(inter_token_latency=0.1)
    running = await start_sluice([sim.url])
    backend = running.sluice.pool.backends[0]
    body = {**CHAT, "max_tokens": 200, "stream": True}
    async with client.stream("POST", running.proxy_url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
        assert backend.inflight == 1

    await wait_until_freed(client, sim, backend)


async def test_client_leaving_before_its_answer_frees_the_backend(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    """Not streamed: nothing is written to the client before the whole answer, so only the
    departure watcher can notice that it left."""
    sim = await start_sim(inter_token_latency=0.1)
    running = await start_sluice([sim.url])
    backend = running.sluice.pool.backends[0]
    host, port = running.proxy_url.removeprefix("http://").split(":")
    body = json.dumps({**CHAT, "max_tokens": 200}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(head.encode() + body)

    async def running_on_the_backend() -> bool:
        return (await client.get(sim.url + "/sim/state")).json()["running"] == 1

    await wait_until(running_on_the_backend)
    await stream.aclose()

    await wait_until_freed(client, sim, backend)


async def test_stream_broken_mid_way_ends_with_an_sse_error_event(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(close_mid_stream=True)
    running = await start_sluice([sim.url])
    body = {**CHAT, "max_tokens": 40, "stream": True}
    with trio.fail_after(5):
        async with client.stream(
            "POST", running.proxy_url + "/v1/chat/completions", json=body
        ) as r:
            assert r.status_code == 200
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert len(events) >= 2
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["code"] == "backend_stream_broken"
    assert events[-1] == "data: [DONE]"
    # The proxy lives on.
    assert (await client.get(running.proxy_url + "/health")).status_code in (200, 503)


async def test_first_byte_timeout_is_504_and_connect_failure_is_502(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    hanging = await start_sim(hang=True)
    running = await start_sluice([hanging.url], first_byte_timeout=0.3)
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "backend_timeout"

    doomed = await start_sim()
    running = await start_sluice([doomed.url], health_check_interval=60)
    doomed.kill()
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "backend_unreachable"


async def test_backend_errors_pass_through_with_their_body(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(error_rate=1.0)
    running = await start_sluice([sim.url], breaker_failures=100)
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 500
    assert response.json()["error"]["message"]
    assert response.headers["x-sluice-backend"] == sim.url


async def rate_limited_backend(exchange: Exchange) -> None:
    """A backend that refuses every completion with its own 429 and body."""
    await exchange.read_body(1 << 20)
    if exchange.path == "/health":
        await exchange.respond_json(200, {})
    elif exchange.path == "/v1/models":
        await exchange.respond_json(
            200, {"object": "list", "data": [{"id": "m", "object": "model"}]}
        )
    else:
        body = {"error": {"message": "slow down", "type": "rate_limit", "param": None, "code": 429}}
        await exchange.respond_json(429, body, headers=[(b"retry-after", b"7")])


async def test_backend_4xx_passes_through(
    start_backend: StartBackend, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    running = await start_sluice([await start_backend(rate_limited_backend)])
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 429
    assert response.json()["error"]["message"] == "slow down"
    assert response.headers["retry-after"] == "7"


async def no_health_backend(exchange: Exchange) -> None:
    """An OpenAI-compatible server with no /health at all (some real ones have none)."""
    await exchange.read_body(1 << 20)
    if exchange.path == "/v1/models":
        models = {"object": "list", "data": [{"id": "bare", "object": "model"}]}
        await exchange.respond_json(200, models)
    else:
        await exchange.respond_json(404, {"detail": "Not Found"})


async def test_backend_without_health_is_probed_on_models(
    start_backend: StartBackend, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    running = await start_sluice([await start_backend(no_health_backend)])
    backend = running.sluice.pool.backends[0]
    assert backend.healthy
    assert backend.probe_path == "/v1/models"
    models = (await client.get(running.proxy_url + "/v1/models")).json()
    assert models["data"][0]["id"] == "bare"


async def test_shutdown_lets_in_flight_streams_finish(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(inter_token_latency=0.02)
    running = await start_sluice([sim.url], shutdown_grace=5.0)
    body = {**CHAT, "max_tokens": 20, "stream": True}
    async with client.stream("POST", running.proxy_url + "/v1/chat/completions", json=body) as r:
        lines = r.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break
        running.sluice.shutdown.set()
        rest = [line async for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    with trio.fail_after(5):
        while True:
            try:
                await client.get(running.proxy_url + "/health")
            except httpx.TransportError:
                break
            await trio.sleep(0.01)
