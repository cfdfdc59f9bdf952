"""`--forward tokens` with I/O (the pure parts are in test_forward_tokens_pure.py): the
tokenizer check against fake backends, then end to end: token ids reach a verified simulated
backend and chat clients still get chat answers, while a backend with another tokenizer gets
nothing, is checked again on re-admission, and passthrough mode sends no probe at all."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from typing import Any

import httpx
import openai
import trio
from openai.types.chat import ChatCompletionMessageParam

from app.fleet.backends import TokenizerProbe
from app.fleet.pool import BackendPool
from app.fleet.tokenizer_check import check_tokenizer
from app.http.fetch import Fetched, Fetcher
from app.sim.server import create_sim_app, serve_sim
from app.sim.tokens import WordTokenizer
from tests.conftest import FAST_SIM, StartSim, StartSluice, set_faults, wait_until

SIM_MODEL = FAST_SIM.served_models[0]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi there."}]
CHAT: dict[str, Any] = {"model": SIM_MODEL, "messages": MESSAGES}

# ---------------------------------------------------------------- the check, fake backends

PROBE = TokenizerProbe("probe", (10, 20, 30))


def pool_with_probe() -> BackendPool:
    pool = BackendPool(("http://b",), failures_to_open=1, cooldown=1.0, probe_path="/health")
    pool.health_checked(pool.backends[0], True)
    pool.require_tokenizer_match(PROBE)
    return pool


def tokenizer_state(pool: BackendPool) -> str:
    """The first backend's state, read afresh (mypy would keep an earlier assert's narrowing)."""
    return pool.backends[0].tokenizer_state


async def run_check(pool: BackendPool, answer: Any) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []

    class Answering(Fetcher):
        async def exchange(self, *request: Any) -> Fetched:
            bodies.append(json.loads(request[3]))  # (base URL, path, method, body, headers)
            status, payload = answer(bodies[-1])
            return Fetched(status, json.dumps(payload).encode())

    await check_tokenizer(pool, pool.backends[0], Answering(connect_timeout=1.0), seconds=1.0)
    return bodies


async def test_llama_cpp_shape_is_tried_when_the_vllm_shape_is_refused() -> None:
    def llama_cpp(body: dict[str, Any]) -> tuple[int, Any]:
        if "content" not in body:
            return 400, {"error": "content is required"}
        return 200, {"tokens": list(PROBE.expected)}

    pool = pool_with_probe()
    bodies = await run_check(pool, llama_cpp)
    assert bodies == [
        {"prompt": "probe", "add_special_tokens": False},
        {"content": "probe", "add_special": False, "parse_special": True},
    ]
    assert pool.backends[0].tokenizer_state == "verified"
    assert pool.backends[0].takes_traffic(0.0)

    # llama.cpp ignores unknown keys and answers 200 with no tokens: also a second try.
    pool = pool_with_probe()
    await run_check(
        pool, lambda b: (200, {"tokens": list(PROBE.expected) if "content" in b else []})
    )
    assert pool.backends[0].tokenizer_state == "verified"


async def test_a_backend_without_tokenize_is_refused_and_a_5xx_is_retried() -> None:
    pool = pool_with_probe()
    assert len(await run_check(pool, lambda b: (404, {}))) == 1
    backend = pool.backends[0]
    assert tokenizer_state(pool) == "refused" and not backend.takes_traffic(0.0)
    assert backend.last_error is not None and "cannot verify" in backend.last_error
    assert await run_check(pool, lambda b: (200, {})) == []  # refused stays refused...
    pool.health_checked(backend, False, "down")
    pool.health_checked(backend, True)  # ...until re-admitted
    await run_check(pool, lambda b: (500, {}))
    assert tokenizer_state(pool) == "unchecked"  # the next health check tries again
    await run_check(pool, lambda b: (200, {"tokens": [10, 20, 31]}))
    assert backend.tokenizer_detail == "mismatch at token 2: backend 31 vs sluice 30"


async def test_passthrough_pools_are_never_probed() -> None:
    pool = BackendPool(("http://b",), failures_to_open=1, cooldown=1.0, probe_path="/health")
    pool.health_checked(pool.backends[0], True)
    assert await run_check(pool, lambda b: (200, {})) == []
    assert pool.snapshot(0.0)[0]["tokenizer"] == "not required"


# ---------------------------------------------------------------- end to end


async def sim_state(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    state: dict[str, Any] = (await client.get(url + "/sim/state")).json()
    return state


async def test_chat_reaches_a_verified_backend_as_token_ids_and_returns_as_chat(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(tokenize_with="default")
    running = await start_sluice([sim.url], forward="tokens")
    # Verified before the proxy listened: one probe, no waiting.
    assert running.sluice.pool.snapshot(0.0)[0]["tokenizer"] == "verified"
    assert (await sim_state(client, sim.url))["tokenize_requests"] == 1

    def talk() -> tuple[Any, Any, list[Any]]:
        oai = openai.OpenAI(base_url=running.proxy_url + "/v1", api_key="k", max_retries=0)
        raw = oai.chat.completions.with_raw_response.create(
            model=SIM_MODEL, messages=MESSAGES, max_completion_tokens=3
        )
        stream = oai.chat.completions.create(
            model=SIM_MODEL,
            messages=MESSAGES,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        return raw.headers, raw.parse(), list(stream)

    headers, whole, chunks = await trio.to_thread.run_sync(talk)
    assert headers["x-sluice-forward"] == "tokens"
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 3
    state = await sim_state(client, sim.url)
    assert state["prompts_by_form"] == {"messages": 0, "text": 0, "token_ids": 2}
    # The backend counted exactly the tokens Sluice computed (its own chat rendering differs).
    assert whole.usage.prompt_tokens == int(headers["x-sluice-prompt-tokens"])

    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 4
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []

    completion = await client.post(
        running.proxy_url + "/v1/completions",
        json={"model": SIM_MODEL, "prompt": "Once upon a time", "max_tokens": 2},
    )
    assert completion.json()["object"] == "text_completion"
    assert completion.headers["x-sluice-forward"] == "tokens"
    assert (await sim_state(client, sim.url))["prompts_by_form"]["token_ids"] == 3


async def test_backend_errors_and_tools_pass_through(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(tokenize_with="default")
    running = await start_sluice([sim.url], forward="tokens")
    url = running.proxy_url + "/v1/chat/completions"
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    response = await client.post(url, json={**CHAT, "tools": [tool], "max_tokens": 2})
    assert response.headers["x-sluice-forward"] == "passthrough (tools)"
    assert response.json()["object"] == "chat.completion"
    assert (await sim_state(client, sim.url))["prompts_by_form"]["messages"] == 1

    await set_faults(client, sim.url, error_rate=1.0)
    response = await client.post(url, json={**CHAT, "max_tokens": 2})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "Simulated internal server error"


async def test_backends_with_another_tokenizer_get_no_traffic(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    verified = await start_sim(tokenize_with="default")
    words = await start_sim()
    mixed = await start_sluice([verified.url, words.url], forward="tokens")
    for _ in range(6):
        response = await client.post(mixed.proxy_url + "/v1/chat/completions", json=CHAT)
        assert response.headers["x-sluice-backend"] == verified.url
    refused = mixed.sluice.pool.snapshot(0.0)[1]
    assert refused["tokenizer"] == "refused"
    assert refused["tokenizer_detail"].startswith("mismatch at token 0: backend ")
    assert refused["last_error"] == refused["tokenizer_detail"]

    alone = await start_sluice([words.url], forward="tokens")
    response = await client.post(alone.proxy_url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "no_verified_backend"
    assert f"{words.url}: mismatch at token 0" in error["message"]
    health = await client.get(alone.proxy_url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "no verified backend"
    assert (await sim_state(client, words.url))["prompts_by_form"] == {
        "messages": 0,
        "text": 0,
        "token_ids": 0,
    }


async def test_a_readmitted_backend_is_checked_again(
    nursery: trio.Nursery, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    settings = dataclasses.replace(FAST_SIM, tokenize_with="default")
    sim = create_sim_app(settings)
    url: str = await nursery.start(partial(serve_sim, settings, app=sim))
    running = await start_sluice([url], forward="tokens")
    pool = running.sluice.pool

    backend = pool.backends[0]

    async def readmit(probes_expected: int) -> None:
        await set_faults(client, url, unhealthy=True)
        await wait_until(lambda: holds(not backend.healthy))
        await set_faults(client, url, unhealthy=False)
        await wait_until(
            lambda: holds(
                sim.tokenize_requests == probes_expected
                and backend.tokenizer_state in ("verified", "refused")
            )
        )

    await readmit(probes_expected=2)
    assert tokenizer_state(pool) == "verified"

    # Replaced by a model with another vocabulary while it was down: refused on return.
    sim.inference.tokenizer = WordTokenizer()
    await readmit(probes_expected=3)
    assert tokenizer_state(pool) == "refused"
    assert backend.tokenizer_detail is not None
    assert backend.tokenizer_detail.startswith("mismatch at token 0")
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)
    assert response.json()["error"]["code"] == "no_verified_backend"


async def test_passthrough_mode_sends_no_probes(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(tokenize_with="default")
    running = await start_sluice([sim.url])
    pool = running.sluice.pool
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=CHAT)
    assert "x-sluice-forward" not in response.headers
    await set_faults(client, sim.url, unhealthy=True)
    await wait_until(lambda: holds(not pool.backends[0].healthy))
    await set_faults(client, sim.url, unhealthy=False)
    await wait_until(lambda: holds(pool.backends[0].healthy))
    state = await sim_state(client, sim.url)
    assert state["tokenize_requests"] == 0
    assert state["prompts_by_form"]["messages"] == 1


async def holds(condition: bool) -> bool:
    """`wait_until` polls a coroutine; the lambda around this re-evaluates `condition`."""
    return condition
