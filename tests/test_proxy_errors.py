"""Every client error path of the proxy answers OpenAI-shaped JSON and leaves it alive:
malformed JSON, missing and mistyped fields, oversized bodies, unknown paths, wrong methods,
no healthy backend."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import RunningSluice, StartSim, StartSluice


@pytest.fixture
async def proxy(start_sim: StartSim, start_sluice: StartSluice) -> RunningSluice:
    sim = await start_sim()
    return await start_sluice([sim.url], max_body_bytes=4096)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"[]", None),
        ("/v1/chat/completions", b'{"model": "m"}', "messages"),
        ("/v1/chat/completions", b'{"model": "m", "messages": []}', "messages"),
        (
            "/v1/chat/completions",
            b'{"model": 3, "messages": [{"role": "user", "content": "x"}]}',
            "model",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}',
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
            "max_tokens",
        ),
        ("/v1/completions", b'{"model": "m"}', "prompt"),
        ("/v1/completions", b'{"model": "m", "prompt": {"a": 1}}', "prompt"),
    ],
)
async def test_bad_requests_are_400_naming_the_param(
    proxy: RunningSluice, client: httpx.AsyncClient, path: str, body: bytes, param: str | None
) -> None:
    response = await client.post(
        proxy.proxy_url + path, content=body, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400, param)


async def test_body_too_large_is_413(proxy: RunningSluice, client: httpx.AsyncClient) -> None:
    big: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    response = await client.post(proxy.proxy_url + "/v1/chat/completions", json=big)
    assert_openai_error(response, 413)


async def test_unknown_path_404_and_wrong_method_405(
    proxy: RunningSluice, client: httpx.AsyncClient
) -> None:
    assert_openai_error(await client.get(proxy.proxy_url + "/v2/nothing"), 404)
    response = await client.get(proxy.proxy_url + "/v1/chat/completions")
    assert_openai_error(response, 405)
    assert response.headers["allow"] == "POST"
    response = await client.post(proxy.proxy_url + "/health")
    assert_openai_error(response, 405)
    assert response.headers["allow"] == "GET"


async def test_no_healthy_backend_is_503_with_retry_after(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(start_unhealthy=True)
    running = await start_sluice([sim.url])
    response = await client.post(
        running.proxy_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
    )
    assert_openai_error(response, 503)
    assert response.headers["retry-after"] == "2"
    assert (await client.get(running.proxy_url + "/health")).status_code == 503
    assert_openai_error(await client.get(running.proxy_url + "/v1/models"), 503)


async def test_proxy_survives_a_barrage_of_garbage(
    proxy: RunningSluice, client: httpx.AsyncClient
) -> None:
    garbage = [b"", b"\x00\x01", b"{}", b'{"model": []}', b'"string"', b"9" * 4000]
    for body in garbage:
        response = await client.post(proxy.proxy_url + "/v1/completions", content=body)
        assert 400 <= response.status_code < 500
    assert (await client.get(proxy.proxy_url + "/health")).status_code == 200
