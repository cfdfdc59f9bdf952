"""The simulated backend over real HTTP (its server on 127.0.0.1, port 0): the OpenAI endpoints
whole and streamed, with httpx and with the official `openai` client (sync in a thread and
async under trio); vLLM's /v1/models, /tokenize, /health and /metrics; OpenAI-shaped errors;
the faults and their runtime switch; and slots freed when a client disconnects.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from app.sim.server import SimServer, create_sim_app, serve_sim
from app.sim.settings import DEFAULT_MODEL, SimSettings
from tests.sims import UNKNOWN_MODEL

FAST = SimSettings(
    port=0,
    models=("sim-test-model",),
    max_model_len=512,
    prefill_overhead=0.001,
    prefill_per_token=0.0,
    inter_token_latency=0.001,
    default_max_tokens=6,
)
# Slow enough that a request is still running when the test looks at it.
SLOW = dataclasses.replace(FAST, inter_token_latency=0.05, max_model_len=100_000)

CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4}


@dataclasses.dataclass
class RunningSim:
    url: str
    app: SimServer
    http: httpx.AsyncClient


@pytest.fixture
async def launch(nursery: trio.Nursery) -> AsyncIterator[Any]:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:

        async def start(settings: SimSettings = FAST, **overrides: Any) -> RunningSim:
            settings = dataclasses.replace(settings, **overrides)
            app = create_sim_app(settings)
            url: str = await nursery.start(partial(serve_sim, settings, app=app))
            return RunningSim(url, app, http)

        yield start


async def sse_events(response: httpx.Response) -> list[Any]:
    events: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --- discovery endpoints ------------------------------------------------------------------


async def test_models_lists_the_model_like_vllm(launch: Any) -> None:
    sim = await launch()
    assert sim.url.startswith("http://127.0.0.1:")
    body = (await sim.http.get(sim.url + "/v1/models")).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == card["root"] == "sim-test-model"
    assert (card["object"], card["owned_by"], card["max_model_len"]) == ("model", "vllm", 512)
    assert isinstance(card["created"], int)


async def test_every_served_name_is_listed_and_answered_under_its_own_name(launch: Any) -> None:
    sim = await launch(models=("base", "base-adapter"))
    cards = (await sim.http.get(sim.url + "/v1/models")).json()["data"]
    assert [(card["id"], card["root"], card["max_model_len"]) for card in cards] == [
        ("base", "base", 512),
        ("base-adapter", "base", 512),
    ]
    for name in ("base", "base-adapter"):
        body = {**CHAT, "model": name}
        answer = (await sim.http.post(sim.url + "/v1/chat/completions", json=body)).json()
        assert answer["model"] == name
    unnamed = (await sim.http.post(sim.url + "/v1/chat/completions", json=CHAT)).json()
    assert unnamed["model"] == "base"  # vLLM's default: the first served name


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "model": "other"}),
        ("/v1/chat/completions", {**CHAT, "model": "other", "stream": True}),
        ("/v1/completions", {"model": "other", "prompt": "Once upon"}),
        ("/tokenize", {"model": "other", "prompt": "Once upon"}),
    ],
)
async def test_any_other_model_gets_vllms_404(launch: Any, path: str, body: dict[str, Any]) -> None:
    sim = await launch()
    response = await sim.http.post(sim.url + path, json=body)
    assert (response.status_code, response.json()) == (404, UNKNOWN_MODEL)
    assert sim.app.engine.prompt_tokens_total == 0


async def test_with_no_model_named_any_name_is_answered(launch: Any) -> None:
    sim = await launch(models=())
    (card,) = (await sim.http.get(sim.url + "/v1/models")).json()["data"]
    assert card["id"] == DEFAULT_MODEL
    body = {**CHAT, "model": "whatever-the-client-says"}
    answer = await sim.http.post(sim.url + "/v1/chat/completions", json=body)
    assert (answer.status_code, answer.json()["model"]) == (200, DEFAULT_MODEL)


async def test_health_is_empty_200_until_made_unhealthy_at_runtime(launch: Any) -> None:
    sim = await launch(start_unhealthy=True)
    assert (await sim.http.get(sim.url + "/health")).status_code == 503
    revived = await sim.http.post(sim.url + "/sim/faults", json={"unhealthy": False})
    assert revived.json()["unhealthy"] is False
    response = await sim.http.get(sim.url + "/health")
    assert (response.status_code, response.content) == (200, b"")


async def test_tokenize_matches_the_prompt_tokens_billed(launch: Any) -> None:
    sim = await launch()
    by_prompt = (await sim.http.post(sim.url + "/tokenize", json={"prompt": "a b  c"})).json()
    assert (by_prompt["count"], by_prompt["max_model_len"]) == (3, 512)
    assert len(by_prompt["tokens"]) == 3

    by_messages = (await sim.http.post(sim.url + "/tokenize", json=CHAT)).json()
    completion = (await sim.http.post(sim.url + "/v1/chat/completions", json=CHAT)).json()
    assert by_messages["count"] == completion["usage"]["prompt_tokens"]


# --- completions ----------------------------------------------------------------------------


async def test_chat_completion_is_openai_shaped_and_reproducible(launch: Any) -> None:
    sim = await launch()
    first = (await sim.http.post(sim.url + "/v1/chat/completions", json=CHAT)).json()
    second = (await sim.http.post(sim.url + "/v1/chat/completions", json=CHAT)).json()
    assert first["object"] == "chat.completion"
    assert first["id"].startswith("chatcmpl-") and first["id"] != second["id"]
    assert first["model"] == "sim-test-model"
    (choice,) = first["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 4
    assert choice["finish_reason"] == "length"
    usage = first["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + 4
    assert choice["message"]["content"] == second["choices"][0]["message"]["content"]


async def test_output_length_follows_max_completion_tokens_or_the_default(launch: Any) -> None:
    sim = await launch()
    url = sim.url + "/v1/chat/completions"
    capped = (await sim.http.post(url, json={**CHAT, "max_completion_tokens": 2})).json()
    assert capped["usage"]["completion_tokens"] == 2
    free = (await sim.http.post(url, json={"messages": CHAT["messages"]})).json()
    assert free["usage"]["completion_tokens"] == FAST.default_max_tokens
    assert free["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("prompt", "prompt_tokens"),
    [("one two three", 3), (["one two three"], 3), ([5, 6, 7, 8], 4), ([[5, 6, 7, 8]], 4)],
)
async def test_completion_prompt_forms(launch: Any, prompt: Any, prompt_tokens: int) -> None:
    sim = await launch()
    response = await sim.http.post(
        sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3}
    )
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert len(body["choices"][0]["text"].split()) == 3


async def test_chat_stream_sends_role_then_one_chunk_per_token_then_usage(launch: Any) -> None:
    sim = await launch()
    request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with sim.http.stream("POST", sim.url + "/v1/chat/completions", json=request) as response:
        assert response.headers["content-type"] == "text/event-stream"
        events = await sse_events(response)
    role, *tokens, usage, done = events
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [chunk["choices"][0]["finish_reason"] for chunk in tokens] == [None] * 3 + ["length"]
    assert all("content" in chunk["choices"][0]["delta"] for chunk in tokens)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert done == "[DONE]"


async def test_completion_stream_sends_text_completion_chunks(launch: Any) -> None:
    sim = await launch()
    request = {"prompt": "hi", "max_tokens": 3, "stream": True}
    async with sim.http.stream("POST", sim.url + "/v1/completions", json=request) as response:
        events = await sse_events(response)
    *chunks, done = events
    assert [chunk["object"] for chunk in chunks] == ["text_completion"] * 3
    assert done == "[DONE]"


# --- the official openai client -----------------------------------------------------------


async def test_sync_openai_client_in_a_thread(launch: Any) -> None:
    sim = await launch()

    def talk() -> tuple[str, list[str], str]:
        client = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
        whole = client.chat.completions.create(
            model="sim-test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        stream = client.chat.completions.create(
            model="sim-test-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
        )
        pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        text = client.completions.create(model="sim-test-model", prompt="hi", max_tokens=2)
        return whole.choices[0].message.content or "", pieces, text.choices[0].text

    whole, pieces, text = await trio.to_thread.run_sync(talk)
    assert whole == "".join(pieces)
    assert len(text.split()) == 2


async def test_async_openai_client_works_under_trio(launch: Any) -> None:
    sim = await launch()
    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="sim-test-model",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3

    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(
            model="sim-test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=600
        )
    assert raised.value.code == "context_length_exceeded"
    await client.close()


# --- errors -----------------------------------------------------------------------------------


async def test_malformed_json_is_an_openai_shaped_400(launch: Any) -> None:
    sim = await launch()
    response = await sim.http.post(sim.url + "/v1/chat/completions", content=b"{not json")
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_prompt_plus_max_tokens_over_max_model_len_is_rejected(launch: Any) -> None:
    sim = await launch()
    response = await sim.http.post(
        sim.url + "/v1/completions", json={"prompt": list(range(500)), "max_tokens": 13}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in error["message"]
    assert "513 tokens (500 in the prompt, 13 in the completion)" in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"content": "no role"}]},
        {**CHAT, "max_tokens": 0},
        {**CHAT, "stream": "yes"},
    ],
)
async def test_invalid_chat_requests_are_400(launch: Any, body: dict[str, Any]) -> None:
    sim = await launch()
    response = await sim.http.post(sim.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400


async def test_unknown_paths_and_methods(launch: Any) -> None:
    sim = await launch()
    assert (await sim.http.get(sim.url + "/nowhere")).status_code == 404
    wrong_method = await sim.http.get(sim.url + "/v1/chat/completions")
    assert (wrong_method.status_code, wrong_method.headers["allow"]) == (405, "POST")


# --- metrics and the prefix cache -------------------------------------------------------------


async def test_metrics_use_vllm_names_and_count_prefix_hits(launch: Any) -> None:
    sim = await launch()
    system = {"role": "system", "content": "Answer in haiku. " * 30}
    for question in ("first question", "second question"):
        request = {"messages": [system, {"role": "user", "content": question}], "max_tokens": 2}
        assert (await sim.http.post(sim.url + "/v1/chat/completions", json=request)).is_success

    text = (await sim.http.get(sim.url + "/metrics")).text
    samples = {
        sample.name: sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert samples[name].labels == {"model_name": "sim-test-model", "engine": "0"}
    assert samples["vllm:generation_tokens_total"].value == 4
    queries = samples["vllm:prefix_cache_queries_total"].value
    assert queries == samples["vllm:prompt_tokens_total"].value
    # The long shared system prompt (about 90 tokens) hits the second time.
    assert 64 <= samples["vllm:prefix_cache_hits_total"].value < queries / 2
    state = (await sim.http.get(sim.url + "/sim/state")).json()
    assert state["prefix_cache_hits"] == samples["vllm:prefix_cache_hits_total"].value


async def test_waiting_requests_are_exported(launch: Any) -> None:
    sim = await launch(SLOW, max_num_seqs=1)
    request = {**CHAT, "max_tokens": 1000}
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(
                partial(sim.http.post, sim.url + "/v1/chat/completions", json=request)
            )
        with trio.fail_after(5):
            await sim.app.engine.wait_until(lambda: sim.app.engine.waiting == 1)
        state = (await sim.http.get(sim.url + "/sim/state")).json()
        assert (state["running"], state["waiting"]) == (1, 1)
        assert 0 < state["kv_cache_usage_perc"] <= 1
        metrics = (await sim.http.get(sim.url + "/metrics")).text
        assert 'vllm:num_requests_waiting{engine="0",model_name="sim-test-model"} 1.0' in metrics
        nursery.cancel_scope.cancel()


# --- faults and disconnects -----------------------------------------------------------------


async def test_error_rate_answers_500_in_a_seeded_pattern(launch: Any) -> None:
    sim = await launch(error_rate=0.5, seed=7)
    statuses = [
        (await sim.http.post(sim.url + "/v1/chat/completions", json=CHAT)).status_code
        for _ in range(12)
    ]
    draws = random.Random(7)
    assert statuses == [500 if draws.random() < 0.5 else 200 for _ in range(12)]
    failed = await launch(error_rate=1.0)
    error = (await failed.http.post(failed.url + "/v1/completions", json={"prompt": "x"})).json()
    assert error["error"]["type"] == "InternalServerError"


async def test_faults_reject_unknown_keys_and_bad_values(launch: Any) -> None:
    sim = await launch()
    changes = (
        {"explode": True},
        {"error_rate": 2},
        {"hang": "yes"},
        {"drop_kv_events": -1},
        {"drop_kv_events": True},
    )
    for change in changes:
        response = await sim.http.post(sim.url + "/sim/faults", json=change)
        assert response.status_code == 400
    assert (await sim.http.get(sim.url + "/sim/state")).json()["faults"] == {
        "error_rate": 0.0,
        "hang": False,
        "close_mid_stream": False,
        "unhealthy": False,
        "drop_kv_events": 0,
    }


async def test_hang_never_answers_until_switched_off(launch: Any) -> None:
    sim = await launch(hang=True)
    with pytest.raises(httpx.ReadTimeout):
        await sim.http.post(sim.url + "/v1/chat/completions", json=CHAT, timeout=0.3)
    await sim.http.post(sim.url + "/sim/faults", json={"hang": False})
    assert (await sim.http.post(sim.url + "/v1/chat/completions", json=CHAT)).is_success


async def test_close_mid_stream_drops_the_connection_without_done(launch: Any) -> None:
    sim = await launch(close_mid_stream=True)
    request = {**CHAT, "max_tokens": 10, "stream": True}
    received: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):
        async with sim.http.stream("POST", sim.url + "/v1/chat/completions", json=request) as r:
            async for line in r.aiter_lines():
                received.append(line)
    data = [line for line in received if line.startswith("data: ")]
    assert len(data) == 3  # the role chunk and two tokens
    assert "data: [DONE]" not in received
    with trio.fail_after(5):
        await sim.app.engine.wait_until(lambda: sim.app.engine.running == 0)


async def test_disconnect_mid_stream_frees_the_slot(launch: Any) -> None:
    sim = await launch(SLOW)
    request = {**CHAT, "max_tokens": 1000, "stream": True}
    async with sim.http.stream("POST", sim.url + "/v1/chat/completions", json=request) as r:
        lines = r.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        assert sim.app.engine.running == 1
    with trio.fail_after(5):
        await sim.app.engine.wait_until(lambda: sim.app.engine.running == 0)
    assert sim.app.engine.kv_cache.used_blocks == 0
    assert sim.app.engine.generation_tokens_total < 1000


async def test_disconnect_while_waiting_for_a_whole_answer_frees_the_slot(launch: Any) -> None:
    sim = await launch(SLOW)
    request = {**CHAT, "max_tokens": 1000}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(sim.http.post, sim.url + "/v1/chat/completions", json=request))
        with trio.fail_after(5):
            await sim.app.engine.wait_until(lambda: sim.app.engine.running == 1)
        nursery.cancel_scope.cancel()
    with trio.fail_after(5):
        await sim.app.engine.wait_until(lambda: sim.app.engine.running == 0)
