"""The endpoints as their official SDKs use them, through Sluice and directly to a simulated
backend: `openai` (embeddings; Responses, whole and streamed, chained by
`previous_response_id` across three backends) and `anthropic` (Messages, whole and
streamed) get the same answers both ways, ids aside. A stored response is found again on
the engine that made it (GET, DELETE, cancel), and is 404 in OpenAI's shape once that
backend has left. A request's W3C trace is continued, reaches the engine, and its spans
reach an OTLP/HTTP collector."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import quote

import anthropic
import httpx
import openai
import pytest
import trio

from tests.conftest import MODEL, StartBackend, StartSim, StartSluice
from tests.test_tracing import Collector

# Ids and clocks differ between two answers; the rest must not.
_VOLATILE = re.compile(r'"(id|created|created_at|item_id)":\s*("[^"]*"|\d+(\.\d+)?)')


def without_ids(text: str) -> str:
    return _VOLATILE.sub(r'"\1":_', text)


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="sk-test", max_retries=0)


async def test_openai_sdk_embeddings_and_responses_match_direct(
    start_sim: StartSim, start_sluice: StartSluice
) -> None:
    sims = [await start_sim() for _ in range(3)]
    running = await start_sluice([s.url for s in sims])

    def exercise(base_url: str) -> list[Any]:
        client = openai_client(base_url)
        embedding = client.embeddings.create(model=MODEL, input="hello world")
        whole = client.responses.create(model=MODEL, input="Tell me", max_output_tokens=6)
        events = [
            event.model_dump_json()
            for event in client.responses.create(
                model=MODEL, input="Tell me", max_output_tokens=6, stream=True
            )
        ]
        return [embedding.data[0].embedding, whole.output_text, whole.usage, events, whole.id]

    through = await trio.to_thread.run_sync(exercise, running.proxy_url)
    direct = await trio.to_thread.run_sync(exercise, sims[0].url)
    assert through[:3] == direct[:3]
    assert [without_ids(e) for e in through[3]] == [without_ids(e) for e in direct[3]]
    assert re.fullmatch(r"resp_\w+-sl[0-9a-f]{8}", through[4])  # the id Sluice hands out


async def test_previous_response_id_always_reaches_the_engine_holding_it(
    start_sim: StartSim, start_sluice: StartSluice
) -> None:
    sims = [await start_sim(seed=i) for i in range(3)]
    running = await start_sluice([s.url for s in sims], policy="round_robin")

    def chain(turns: int) -> list[tuple[str, str]]:
        client = openai_client(running.proxy_url)
        reached = []
        previous = None
        for turn in range(turns):
            raw = client.responses.with_raw_response.create(
                model=MODEL,
                input=f"turn {turn}",
                max_output_tokens=3,
                previous_response_id=previous,
            )
            response = raw.parse()
            assert response.previous_response_id == previous  # tagged as it was handed out
            reached.append((previous or "", raw.headers["x-sluice-backend"]))
            previous = response.id
        return reached

    reached = await trio.to_thread.run_sync(chain, 12)
    owners = {backend for _, backend in reached}
    assert len(owners) == 1  # every follow-up went to the first answer's engine
    # Independent chains start on every backend (round robin), and each stays on its own.
    firsts = [await trio.to_thread.run_sync(chain, 2) for _ in range(3)]
    assert {chain_[0][1] for chain_ in firsts} == {s.url for s in sims}
    assert all(chain_[0][1] == chain_[1][1] for chain_ in firsts)


async def test_a_stored_response_is_got_cancelled_and_deleted_on_its_engine(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sims = [await start_sim(seed=i) for i in range(3)]
    running = await start_sluice([s.url for s in sims])
    url = running.proxy_url
    body = {"model": MODEL, "input": "keep me", "max_output_tokens": 3}
    made = await client.post(url + "/v1/responses", json=body)
    response_id = made.json()["id"]
    owner = made.headers["x-sluice-backend"]
    for _ in range(3):
        got = await client.get(f"{url}/v1/responses/{response_id}")
        assert got.status_code == 200, got.text
        assert got.json()["id"] == response_id and got.headers["x-sluice-backend"] == owner
    items = await client.get(f"{url}/v1/responses/{response_id}/input_items")
    assert items.headers["x-sluice-backend"] == owner  # the engine's own answer, 404 or not
    cancelled = await client.post(f"{url}/v1/responses/{response_id}/cancel")
    assert cancelled.headers["x-sluice-backend"] == owner  # the engine's own answer
    deleted = await client.delete(f"{url}/v1/responses/{response_id}")
    assert deleted.status_code == 200, deleted.text
    gone = await client.get(f"{url}/v1/responses/{response_id}")
    assert gone.status_code == 404  # the engine says so
    for unknown in ("resp_abc", response_id[:-8] + "00000000"):
        answer = await client.get(f"{url}/v1/responses/{unknown}")
        assert answer.status_code == 404
        assert answer.json()["error"]["code"] == "response_not_found"
    wrong = await client.put(f"{url}/v1/responses/{response_id}")
    assert wrong.status_code == 405
    # Its backend leaves the pool: the id is 404 in OpenAI's shape, so is a follow-up.
    kept = await client.post(url + "/v1/responses", json=body)
    kept_id = kept.json()["id"]
    kept_owner = quote(kept.headers["x-sluice-backend"], safe="")
    removed = await client.delete(f"{running.dashboard_url}/api/backends/{kept_owner}")
    assert removed.is_success, removed.text
    after = await client.get(f"{url}/v1/responses/{kept_id}")
    assert after.status_code == 404 and after.json()["error"]["code"] == "response_not_found"
    follow_up = await client.post(
        url + "/v1/responses", json={**body, "previous_response_id": kept_id}
    )
    assert follow_up.status_code == 404
    assert follow_up.json()["error"]["param"] == "previous_response_id"


async def test_anthropic_sdk_messages_match_direct(
    start_sim: StartSim, start_sluice: StartSluice
) -> None:
    sims = [await start_sim() for _ in range(2)]
    running = await start_sluice([s.url for s in sims])

    def exercise(base_url: str) -> list[Any]:
        client = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)
        asked: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 8,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hello"}],
        }
        whole = client.messages.create(**asked)
        with client.messages.stream(**asked) as stream:
            events = [event.model_dump_json() for event in stream]
            final = stream.get_final_message()
        return [whole.content, whole.usage, whole.stop_reason, final.content, events]

    through = await trio.to_thread.run_sync(exercise, running.proxy_url)
    direct = await trio.to_thread.run_sync(exercise, sims[0].url)
    assert through[:4] == direct[:4]
    assert [without_ids(e) for e in through[4]] == [without_ids(e) for e in direct[4]]


async def test_a_requests_trace_reaches_the_engine_the_collector_and_the_access_log(
    start_sim: StartSim,
    start_sluice: StartSluice,
    start_backend: StartBackend,
    client: httpx.AsyncClient,
    capsys: pytest.CaptureFixture[str],
) -> None:
    collector = Collector()
    collector_url = await start_backend(collector)
    sim = await start_sim()
    running = await start_sluice([sim.url], otlp_endpoint=collector_url, access_log="json")
    trace_id, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    answer = await client.post(
        running.proxy_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        headers={"traceparent": f"00-{trace_id}-{caller_span}-01"},
    )
    assert answer.status_code == 200
    await running.sluice.tracer.flush()
    spans = [span for _, span in collector.spans() if span.trace_id.hex() == trace_id]
    assert len(spans) >= 5, [span.name for span in spans]
    (server,) = [span for span in spans if span.parent_span_id.hex() == caller_span]
    assert server.name == "POST /v1/chat/completions"
    names = {span.name for span in spans if span is not server}
    assert {"route", "upstream.connect", "upstream.first_byte", "relay"} <= names
    assert all(s.parent_span_id == server.span_id for s in spans if s is not server)
    state = (await client.get(sim.url + "/sim/state")).json()
    engine_saw = state["traceparents"][-1]
    assert engine_saw == f"00-{trace_id}-{server.span_id.hex()}-01"
    snapshot = (await client.get(running.dashboard_url + "/api/snapshot")).json()
    assert snapshot["requests"]["recent"][0]["trace_id"] == trace_id  # newest first
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert 'sluice_trace_spans_total{outcome="exported"}' in metrics
    access_log = running.sluice.access_log
    assert access_log is not None
    await access_log.flush()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if '"seq"' in line]
    assert [(line["kind"], line["status"], line["trace_id"]) for line in lines] == [
        ("chat", 200, trace_id)
    ]
    assert lines[0]["seq"] == snapshot["requests"]["recent"][0]["seq"]
