"""Every endpoint the engines serve, through Sluice to simulated backends, as raw HTTP does
it: each answers 200 through the proxy, 404 `model_not_found` for a model nobody serves,
401 without a key when keys are on, survives a killed backend by a retry, and is counted by
its endpoint in /metrics and in the request log. Streams that end untidily: cut after their
engine finished them they end cleanly (and are counted); cut before, they get their own
API's error event."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from app.http.exchange import Exchange
from tests.conftest import MODEL, RunningSluice, StartBackend, StartSim, StartSluice

AUDIO = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(32)

# path -> a JSON body naming `model` (None: a multipart upload).
ENDPOINTS: dict[str, dict[str, Any] | None] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "Once upon", "max_tokens": 3},
    "/v1/responses": {"input": "hello there", "max_output_tokens": 3},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/embeddings": {"input": "hello"},
    "/v1/rerank": {"query": "a", "documents": ["b", "c"]},
    "/rerank": {"query": "a", "documents": ["b", "c"]},
    "/v2/rerank": {"query": "a", "documents": ["b", "c"]},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/score": {"text_1": "a", "text_2": "b"},
    "/v1/classify": {"input": "a"},
    "/classify": {"input": "a"},
    "/pooling": {"input": "a"},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/audio/transcriptions": None,
    "/v1/audio/translations": None,
}
ENDPOINT_NAMES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/embeddings": "embeddings",
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
}


def endpoint_name(path: str) -> str:
    return ENDPOINT_NAMES.get(path, path.rsplit("/", 1)[1])


async def post(
    client: httpx.AsyncClient, url: str, path: str, model: str, **kw: Any
) -> httpx.Response:
    body = ENDPOINTS[path]
    if body is None:
        files = {"file": ("a.wav", AUDIO, "audio/wav")}
        return await client.post(url + path, data={"model": model}, files=files, **kw)
    return await client.post(url + path, json={"model": model, **body}, **kw)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one series in a /metrics page (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_every_endpoint_is_routed_by_model_retried_counted_and_logged(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sims = [await start_sim(seed=i) for i in range(3)]
    running = await start_sluice(
        [s.url for s in sims],
        policy="round_robin",
        health_check_interval=60,  # the dead one is found by the requests, not the checks
        breaker_failures=1000,  # and tried again each round
    )
    sims[0].kill()
    url = running.proxy_url
    for path in ENDPOINTS:
        before = (await client.get(url + "/metrics")).text
        for _ in range(3):  # round robin: one of the three first goes to the dead backend
            answer = await post(client, url, path, MODEL)
            assert answer.status_code == 200, (path, answer.text)
            assert answer.headers["x-sluice-backend"] != sims[0].url
        unknown = await post(client, url, path, "no-such-model")
        assert unknown.status_code == 404, (path, unknown.text)
        assert unknown.json()["error"]["code"] == "model_not_found"
        after = (await client.get(url + "/metrics")).text
        name = endpoint_name(path)
        served = metric(after, "sluice_requests_total", endpoint=name, code="200", model=MODEL)
        assert served - metric(before, "sluice_requests_total", endpoint=name, code="200") >= 3
        assert metric(after, "sluice_requests_total", endpoint=name, code="404") >= 1
        failed = {"backend": sims[0].url, "code": "error"}
        assert metric(after, "sluice_backend_requests_total", **failed) > metric(
            before, "sluice_backend_requests_total", **failed
        ), path
    snapshot = (await client.get(running.dashboard_url + "/api/snapshot")).json()
    logged = {record["kind"] for record in snapshot["requests"]["recent"]}
    assert {endpoint_name(path) for path in ENDPOINTS} <= logged


async def test_with_keys_every_endpoint_needs_one_and_a_keys_models_apply(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    sim = await start_sim(models=(MODEL, "other"))
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nkey = "sk-all"\n\n[[keys]]\nkey = "sk-other"\nmodels = ["other"]\n')
    running = await start_sluice([sim.url], api_keys=str(keys))
    url = running.proxy_url
    for path in ENDPOINTS:
        missing = await post(client, url, path, MODEL)
        assert missing.status_code == 401, (path, missing.text)
        assert missing.json()["error"]["code"] == "invalid_api_key"
        bearer = {"authorization": "Bearer sk-all"}
        assert (await post(client, url, path, MODEL, headers=bearer)).status_code == 200, path
        # Anthropic's SDKs send their key as x-api-key.
        anthropic_style = {"x-api-key": "sk-all"}
        assert (await post(client, url, path, MODEL, headers=anthropic_style)).status_code == 200
        not_its = await post(client, url, path, MODEL, headers={"x-api-key": "sk-other"})
        assert not_its.status_code == 404 and not_its.json()["error"]["code"] == "model_not_found"


async def test_an_uploads_model_is_read_from_its_form_and_a_bad_form_is_refused(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(models=(MODEL, "other"))  # two: a form must name its model
    running = await start_sluice([sim.url])
    path = running.proxy_url + "/v1/audio/transcriptions"
    answer = await client.post(
        path, data={"model": MODEL}, files={"file": ("a.wav", AUDIO, "audio/wav")}
    )
    assert answer.status_code == 200 and "text" in answer.json()
    no_model = await client.post(path, files={"file": ("a.wav", AUDIO, "audio/wav")})
    assert no_model.status_code == 400, no_model.text
    assert no_model.json()["error"]["param"] == "model"
    # With one model served an upload may name none; it goes on as it came, a form still.
    single = await start_sluice([(await start_sim()).url])
    unnamed = await client.post(
        single.proxy_url + "/v1/audio/transcriptions",
        files={"file": ("a.wav", AUDIO, "audio/wav")},
    )
    assert unnamed.status_code == 200 and "text" in unnamed.json(), unnamed.text
    not_a_form = await client.post(
        path, content=b"junk", headers={"content-type": "multipart/form-data; boundary=x"}
    )
    assert not_a_form.status_code == 400
    assert not_a_form.json()["error"]["type"] == "invalid_request_error"


# --- streams that end untidily --------------------------------------------------------

STREAMS = {
    "/v1/chat/completions": (
        b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n',
        b"data: [DONE]\n\n",
    ),
    "/v1/responses": (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"delta":"hi"}\n\n',
        b'event: response.completed\ndata: {"type":"response.completed","response":{}}\n\n',
    ),
    "/v1/messages": (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"hi"}}\n\n',
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ),
}


def cutting_backend(finish: bool) -> Any:
    """A backend whose streams are cut without their chunked ending: after their engine's
    end marker (`finish`), as llama-cpp-python's server does, or before it."""

    async def handler(exchange: Exchange) -> None:
        if exchange.method == "GET":
            models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            await exchange.respond_json(200, models)
            return
        await exchange.read_body(1 << 20)
        middle, end = STREAMS[exchange.path]
        await exchange.start(200, [(b"content-type", b"text/event-stream")], complete=False)
        await exchange.write(middle + (end if finish else b""))
        raise trio.BrokenResourceError("cut")  # the connection drops, unfinished

    return handler


async def stream_through(client: httpx.AsyncClient, running: RunningSluice, path: str) -> bytes:
    """The bytes of a streamed request to `path` through the proxy, as the client got them."""
    body = {"model": MODEL, "stream": True, **(ENDPOINTS[path] or {})}
    async with client.stream("POST", running.proxy_url + path, json=body) as answer:
        return b"".join([chunk async for chunk in answer.aiter_bytes()])


@pytest.mark.parametrize("path", list(STREAMS))
async def test_a_stream_cut_after_its_end_ends_cleanly_and_is_counted(
    start_backend: StartBackend, start_sluice: StartSluice, client: httpx.AsyncClient, path: str
) -> None:
    running = await start_sluice([await start_backend(cutting_backend(finish=True))])
    received = await stream_through(client, running, path)
    middle, end = STREAMS[path]
    assert received == middle + end  # byte for byte, nothing added
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert metric(metrics, "sluice_untidy_streams_total", endpoint=endpoint_name(path)) == 1


@pytest.mark.parametrize("path", list(STREAMS))
async def test_a_stream_cut_before_its_end_gets_its_apis_error_event(
    start_backend: StartBackend, start_sluice: StartSluice, client: httpx.AsyncClient, path: str
) -> None:
    running = await start_sluice([await start_backend(cutting_backend(finish=False))])
    received = await stream_through(client, running, path)
    middle, _ = STREAMS[path]
    assert received.startswith(middle)
    error_event = received[len(middle) :]
    data = [line for line in error_event.split(b"\n") if line.startswith(b"data: ")]
    payload = json.loads(data[0].removeprefix(b"data: "))
    if path == "/v1/chat/completions":
        assert payload["error"]["code"] == "backend_stream_broken"
        assert data[-1] == b"data: [DONE]"
    elif path == "/v1/responses":
        assert error_event.startswith(b"event: error\n")
        assert payload["type"] == "error" and payload["code"] == "backend_stream_broken"
    else:
        assert error_event.startswith(b"event: error\n")
        assert payload == {
            "type": "error",
            "error": {"type": "api_error", "message": payload["error"]["message"]},
        }
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert metric(metrics, "sluice_untidy_streams_total", endpoint=endpoint_name(path)) == 0
