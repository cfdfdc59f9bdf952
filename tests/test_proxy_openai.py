"""The proxy seen by the official `openai` client and by raw HTTP: models, chat and
completions, stream and not, through `Sluice` in front of simulated backends; the
headers every proxied response carries; SSE relayed as it arrives, not buffered."""

from __future__ import annotations

import json

import httpx
import openai
import trio

from tests.conftest import StartSim, StartSluice, wait_until


async def test_openai_client_models_chat_and_completions(
    start_sim: StartSim, start_sluice: StartSluice
) -> None:
    sims = [await start_sim(seed=i) for i in range(2)]
    running = await start_sluice([s.url for s in sims])
    oai = openai.OpenAI(base_url=running.proxy_url + "/v1", api_key="test-key", max_retries=0)

    def exercise() -> None:
        models = oai.models.list()
        assert models.data and models.data[0].id
        model = models.data[0].id

        chat = oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=5
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 5

        pieces = [
            chunk.choices[0].delta.content or ""
            for chunk in oai.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Stream please"}],
                max_tokens=6,
                stream=True,
            )
            if chunk.choices
        ]
        assert "".join(pieces)

        completion = oai.completions.create(model=model, prompt="Once upon", max_tokens=4)
        assert completion.choices[0].text
        streamed = "".join(
            c.choices[0].text
            for c in oai.completions.create(
                model=model, prompt=[1, 2, 3], max_tokens=4, stream=True
            )
            if c.choices
        )
        assert streamed

    await trio.to_thread.run_sync(exercise)


async def test_proxied_responses_carry_sluice_headers(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    running = await start_sluice([sim.url], policy="round_robin")
    response = await client.post(
        running.proxy_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"x-request-id": "abc-123", "connection": "keep-alive"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-sluice-backend"] == sim.url
    assert response.headers["x-sluice-route"] == "round_robin:rotation"
    assert response.headers["x-request-id"] == "abc-123"
    timing = response.headers["server-timing"]
    for part in ("template;dur=", "tokenize;dur=", "route;dur="):
        assert part in timing
    generated = await client.post(
        running.proxy_url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}
    )
    assert len(generated.headers["x-request-id"]) == 32


async def test_stream_chunks_arrive_before_the_backend_finishes(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(inter_token_latency=0.2)
    running = await start_sluice([sim.url])
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "slow"}],
        "max_tokens": 50,
        "stream": True,
    }
    async with client.stream("POST", running.proxy_url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.aiter_lines()
        first = await lines.__anext__()
        while not first.startswith("data: "):
            first = await lines.__anext__()
        chunk = json.loads(first.removeprefix("data: "))
        assert chunk["object"] == "chat.completion.chunk"
        # The backend still has ~10 s of tokens to go: the proxy relayed, not buffered.
        state = (await client.get(sim.url + "/sim/state")).json()
        assert state["running"] == 1


async def test_health_models_and_metrics_endpoints(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    running = await start_sluice([sim.url])
    health = await client.get(running.proxy_url + "/health")
    assert health.status_code == 200
    assert health.json()["healthy_backends"] == 1
    models = (await client.get(running.proxy_url + "/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["max_model_len"] > 0
    await client.post(
        running.proxy_url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}
    )

    async def counted_and_settled() -> bool:
        # The client may read the response before the proxy's bookkeeping runs.
        text = (await client.get(running.proxy_url + "/metrics")).text
        return (
            f'sluice_backend_requests_total{{backend="{sim.url}",code="200"}} 1.0' in text
            and f'sluice_backend_inflight_requests{{backend="{sim.url}"}} 0.0' in text
        )

    await wait_until(counted_and_settled)
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert f'sluice_backend_healthy{{backend="{sim.url}"}} 1.0' in metrics
    assert "sluice_proxy_overhead_seconds_count 1.0" in metrics
    assert 'sluice_route_decisions_total{policy="cache_aware",reason="least-load"}' in metrics
