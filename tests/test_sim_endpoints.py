"""The simulated backend's other vLLM endpoints over real HTTP (`start_sim`, port 0).

Covered: the pooling endpoints (`/v1/embeddings` in floats and base64, `/rerank`, `/score`,
`/classify`, `/pooling`) in vLLM's shapes and on the engine's load model (prompt tokens
counted, none generated); `/tokenize` and `/detokenize`; `/v1/audio/transcriptions` from a
strict multipart form (json, text, verbose_json, streamed) and its reader alone; the
Responses API whole, streamed (event order and sequence numbers), stored, retrieved,
deleted, chained by `previous_response_id` (the prompt grows and the prefix cache serves it)
and cancelled in the background; Anthropic's `/v1/messages` whole and streamed; the
official `openai` SDK (embeddings, responses create/stream/retrieve/delete, transcriptions)
and `anthropic` SDK (messages.create, messages.stream) against them; the faults on the new
endpoints; the traceparents /sim/state keeps; and the 404s for unknown response ids,
unknown models and unknown paths (FastAPI's `{"detail": "Not Found"}`, as vLLM answers).
"""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from app.sim.multipart import FormError, boundary_of, read_form
from app.sim.response_store import ResponseStore, StoredResponse
from tests.conftest import MODEL, StartSim, set_faults, wait_until

WAV = b"RIFF" + bytes(range(256)) * 40  # any bytes are audio to the sim
UNKNOWN_MODEL = {
    "error": {
        "message": "The model `other` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
}


async def named_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of an `event:` + `data:` stream; a bare `data:` has name ''."""
    events, name = [], ""
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: ") and line != "data: [DONE]":
            events.append((name, json.loads(line.removeprefix("data: "))))
            name = ""
    return events


async def samples(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(url + "/metrics")).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# --- paths ------------------------------------------------------------------------------------


async def test_unknown_paths_and_methods_answer_as_vllm_does(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    for path in ("/nowhere", "/v1/responses/", "/v1/responses/resp_x/input_items"):
        response = await client.get(sim.url + path)
        assert (response.status_code, response.json()) == (404, {"detail": "Not Found"})
    wrong = await client.get(sim.url + "/v1/embeddings")
    assert (wrong.status_code, wrong.json()) == (405, {"detail": "Method Not Allowed"})
    assert wrong.headers["allow"] == "POST"
    assert (await client.head(sim.url + "/v1/models")).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": "hi"}),
        ("/rerank", {"query": "q", "documents": ["d"]}),
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/classify", {"input": "hi"}),
        ("/pooling", {"input": "hi"}),
        ("/detokenize", {"tokens": [1]}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
async def test_unknown_models_get_vllms_404(
    start_sim: StartSim, client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    sim = await start_sim()
    response = await client.post(sim.url + path, json={**body, "model": "other"})
    assert (response.status_code, response.json()) == (404, UNKNOWN_MODEL)


# --- pooling ----------------------------------------------------------------------------------


async def test_embeddings_are_deterministic_unit_vectors_in_vllms_shape(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    body = {"model": MODEL, "input": ["the cache", "the cache", "a router"]}
    answer = (await client.post(sim.url + "/v1/embeddings", json=body)).json()
    assert answer["id"].startswith("embd-") and answer["object"] == "list"
    assert answer["model"] == MODEL and isinstance(answer["created"], int)
    assert answer["usage"] == {
        "prompt_tokens": 6,
        "total_tokens": 6,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    first, again, other = answer["data"]
    assert [item["index"] for item in answer["data"]] == [0, 1, 2]
    assert first["object"] == "embedding" and len(first["embedding"]) == 256
    assert first["embedding"] == again["embedding"] != other["embedding"]
    assert math.isclose(sum(value * value for value in first["embedding"]), 1.0)

    small = {"model": MODEL, "input": [[5, 6, 7]], "dimensions": 8, "encoding_format": "base64"}
    packed = (await client.post(sim.url + "/v1/embeddings", json=small)).json()["data"][0]
    vector = struct.unpack("<8f", base64.b64decode(packed["embedding"]))
    assert math.isclose(sum(value * value for value in vector), 1.0, rel_tol=1e-5)
    refused: list[dict[str, Any]] = [
        {"input": []},
        {"input": [[]]},
        {"input": 3},
        {"input": [[-1]]},
    ]
    for bad in refused:
        assert (await client.post(sim.url + "/v1/embeddings", json=bad)).status_code == 400


async def test_openai_sdk_embeddings_decode_the_default_base64(start_sim: StartSim) -> None:
    sim = await start_sim()
    sdk = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    default = await sdk.embeddings.create(model=MODEL, input=["a router", "the cache"])
    floats = await sdk.embeddings.create(model=MODEL, input="a router", encoding_format="float")
    await sdk.close()
    assert [item.index for item in default.data] == [0, 1]
    assert default.data[0].embedding == pytest.approx(floats.data[0].embedding, rel=1e-6)
    assert default.usage.prompt_tokens == 4


async def test_rerank_score_classify_and_pooling_shapes(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    documents = ["the weather is fine", "prefix caching saves the prefill", "hello"]
    rerank = {"model": MODEL, "query": "prefix caching", "documents": documents, "top_n": 2}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        answer = (await client.post(sim.url + path, json=rerank)).json()
        assert answer["id"].startswith("rerank-") and answer["model"] == MODEL
        assert answer["usage"] == {"prompt_tokens": 16, "total_tokens": 16}  # 3 x 2 + 10
        scores = [result["relevance_score"] for result in answer["results"]]
        assert len(scores) == 2 and scores == sorted(scores, reverse=True)
        assert answer["results"][0] == {
            "index": 1,
            "document": {"text": documents[1]},
            "relevance_score": scores[0],
        }

    score = {"model": MODEL, "text_1": "prefix caching", "text_2": documents}
    for path in ("/score", "/v1/score"):
        answer = (await client.post(sim.url + path, json=score)).json()
        assert answer["id"].startswith("score-") and answer["object"] == "list"
        assert [item["object"] for item in answer["data"]] == ["score"] * 3
        assert all(0.0 <= item["score"] <= 1.0 for item in answer["data"])
    pairwise = {"model": MODEL, "text_1": ["a", "b"], "text_2": ["a", "b"]}
    assert len((await client.post(sim.url + "/score", json=pairwise)).json()["data"]) == 2
    mismatched = {"model": MODEL, "text_1": ["a", "b"], "text_2": ["a", "b", "c"]}
    assert (await client.post(sim.url + "/score", json=mismatched)).status_code == 400

    for path in ("/classify", "/v1/classify"):
        answer = (await client.post(sim.url + path, json={"input": ["a", "b c"]})).json()
        assert answer["id"].startswith("classify-") and answer["usage"]["prompt_tokens"] == 3
        for index, item in enumerate(answer["data"]):
            assert (item["index"], item["num_classes"]) == (index, 2)
            assert item["label"] in ("LABEL_0", "LABEL_1")
            assert math.isclose(sum(item["probs"]), 1.0)

    pooled = (await client.post(sim.url + "/pooling", json={"input": "pool me"})).json()
    assert pooled["id"].startswith("pool-") and pooled["object"] == "list"
    assert pooled["data"][0]["object"] == "pooling" and len(pooled["data"][0]["data"]) == 256


async def test_pooling_is_a_prefill_on_the_engine_counted_in_metrics(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    before = await samples(client, sim.url)
    body = {"input": ["one two three", "four five"]}
    assert (await client.post(sim.url + "/v1/embeddings", json=body)).is_success
    after = await samples(client, sim.url)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 5
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"]
    assert sim.app.engine.steps >= 1 and sim.app.engine.running == 0


# --- tokenize -------------------------------------------------------------------------------


async def test_detokenize_reads_back_what_tokenize_gave(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    text = "Tokens come back as text."
    tokens = (await client.post(sim.url + "/tokenize", json={"prompt": text})).json()["tokens"]
    answer = await client.post(sim.url + "/detokenize", json={"model": MODEL, "tokens": tokens})
    assert answer.json() == {"prompt": text}
    for bad in ([-1], [10**9], "1 2"):
        response = await client.post(sim.url + "/detokenize", json={"tokens": bad})
        assert response.status_code == 400


# --- transcriptions -----------------------------------------------------------------------


async def test_transcriptions_answer_any_audio_the_same_way_every_time(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    url = sim.url + "/v1/audio/transcriptions"
    files = {"file": ("clip.wav", WAV, "audio/wav")}
    first = (await client.post(url, data={"model": MODEL}, files=files)).json()
    again = (await client.post(url, data={"model": MODEL}, files=files)).json()
    assert first == again and len(first["text"].split()) == 16
    assert first["usage"] == {"type": "duration", "seconds": 1}
    # vLLM answers `text` with the same JSON (its router serialises every answer as JSON).
    as_text = await client.post(url, data={"response_format": "text"}, files=files)
    assert as_text.headers["content-type"] == "application/json" and as_text.json() == first
    verbose = await client.post(url, data={"response_format": "verbose_json"}, files=files)
    assert verbose.json()["text"] == first["text"] and verbose.json()["language"] == "en"
    other = await client.post(url, files={"file": ("b.wav", WAV + b"x", "audio/wav")})
    assert other.json()["text"] != first["text"]

    stream = {"stream": "true", "stream_include_usage": "true", "max_completion_tokens": "3"}
    async with client.stream("POST", url, data=stream, files=files) as response:
        chunks = [data for _, data in await named_events(response)]
    assert [chunk["object"] for chunk in chunks] == ["transcription.chunk"] * 4
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["usage"]["completion_tokens"] == 3

    refused = [
        await client.post(url, data={"model": MODEL}),  # no file (and not multipart)
        await client.post(url, data={"model": MODEL, "file": "not a file"}, files={"x": b""}),
        await client.post(url, data={"response_format": "srt"}, files=files),
        await client.post(url, content=b"--b\r\n", headers={"content-type": "text/plain"}),
    ]
    assert [response.status_code for response in refused] == [400] * 4
    unknown = await client.post(url, data={"model": "other"}, files=files)
    assert (unknown.status_code, unknown.json()) == (404, UNKNOWN_MODEL)


async def test_openai_sdk_transcribes(start_sim: StartSim) -> None:
    sim = await start_sim()

    def transcribe() -> str:
        sdk = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
        return sdk.audio.transcriptions.create(model=MODEL, file=("a.wav", WAV), language="en").text

    text = await trio.to_thread.run_sync(transcribe)
    assert len(text.split()) == 16


def test_the_multipart_reader_is_strict() -> None:
    boundary = boundary_of(b'multipart/form-data; charset=utf-8; boundary="a b"')
    assert boundary == b"a b"
    body = (
        b'--a b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
        b'--a b\r\nContent-Disposition: form-data; name="file"; filename="x\\"y.wav"\r\n'
        b"Content-Type: audio/wav\r\n\r\n\r\nRIFF\r\n--a b--\r\n"
    )
    model, audio = read_form(body, boundary)
    assert (model.name, model.filename, model.text()) == ("model", None, "m")
    assert (audio.filename, audio.content_type, audio.data) == ('x"y.wav', "audio/wav", b"\r\nRIFF")
    refused_types = (
        None,
        b"application/json",
        b"multipart/form-data",
        b'multipart/form-data; boundary="a "',
        b"multipart/form-data; boundary=a; boundary=b",
    )
    for content_type in refused_types:
        with pytest.raises(FormError):
            boundary_of(content_type)
    disposition = b'Content-Disposition: form-data; name="f"\r\n\r\n1\r\n'
    broken = (
        b"preamble\r\n--b\r\n" + disposition + b"--b--",  # a preamble
        b"--b\r\n" + disposition + b"--b\r\n" + disposition + b"--b--",  # a name twice
        b"--b\r\n" + disposition + b"--b",  # never closed
        b"--b\r\n" + disposition + b"--b--trailing",  # data after the close
        b"--b\r\nContent-Type: text/plain\r\n\r\n1\r\n--b--",  # no Content-Disposition
        b"--b\r\n folded: x\r\n" + disposition + b"--b--",  # a folded header line
    )
    for body in broken:
        with pytest.raises(FormError):
            read_form(body, b"b")


# --- the Responses API ------------------------------------------------------------------------


async def test_a_response_whole_is_stored_retrieved_and_deleted(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    body = {"model": MODEL, "input": "Say something.", "instructions": "Be brief."}
    response = (await client.post(sim.url + "/v1/responses", json=body)).json()
    assert response["id"].startswith("resp_") and response["object"] == "response"
    assert (response["status"], response["model"], response["instructions"]) == (
        "completed",
        MODEL,
        "Be brief.",
    )
    (message,) = response["output"]
    assert message["id"].startswith("msg_")
    assert (message["type"], message["role"], message["status"]) == (
        "message",
        "assistant",
        "completed",
    )
    (part,) = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    assert len(part["text"].split()) == 16
    usage = response["usage"]
    assert usage["output_tokens"] == 16 and usage["output_tokens_details"] == {
        "reasoning_tokens": 0
    }
    assert usage["total_tokens"] == usage["input_tokens"] + 16
    assert usage["input_tokens_details"] == {"cached_tokens": 0}

    item = f"{sim.url}/v1/responses/{response['id']}"
    assert (await client.get(item)).json() == response
    deleted = await client.delete(item)
    assert deleted.json() == {"id": response["id"], "object": "response", "deleted": True}
    missing = await client.get(item)
    assert (missing.status_code, missing.json()) == (
        404,
        {
            "error": {
                "message": f"Response with id '{response['id']}' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        },
    )
    assert (await client.delete(item)).status_code == 404
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"},
    ]
    listed = await client.post(sim.url + "/v1/responses", json={"input": items})
    assert listed.json()["usage"]["input_tokens"] > 10
    unstored = {**body, "store": False}
    kept = (await client.post(sim.url + "/v1/responses", json=unstored)).json()
    assert (await client.get(f"{sim.url}/v1/responses/{kept['id']}")).status_code == 404
    for bad in ({"input": 3}, {"input": [{"role": "nobody"}]}, {"input": "x", "stream": "no"}):
        assert (await client.post(sim.url + "/v1/responses", json=bad)).status_code == 400


async def test_a_streamed_response_sends_vllms_events_in_order(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    body = {"model": MODEL, "input": "Stream it.", "stream": True, "max_output_tokens": 3}
    async with client.stream("POST", sim.url + "/v1/responses", json=body) as response:
        assert response.headers["content-type"] == "text/event-stream"
        events = await named_events(response)
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = "".join(data["delta"] for name, data in events if name.endswith(".delta"))
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 3
    assert final["output"][0]["content"][0]["text"] == deltas == events[7][1]["text"]
    stored = (await client.get(f"{sim.url}/v1/responses/{final['id']}")).json()
    assert stored == final


async def test_openai_sdk_creates_streams_retrieves_and_deletes_responses(
    start_sim: StartSim,
) -> None:
    sim = await start_sim()
    sdk = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    whole = await sdk.responses.create(model=MODEL, input="Hello.", max_output_tokens=4)
    assert whole.status == "completed" and len(whole.output_text.split()) == 4
    stream = await sdk.responses.create(model=MODEL, input="Hello.", stream=True)
    events = [event async for event in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text
    again = await sdk.responses.retrieve(whole.id)
    assert (again.id, again.output_text) == (whole.id, whole.output_text)
    await sdk.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(whole.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.create(model="other", input="Hello.")
    await sdk.close()


async def test_previous_response_id_continues_the_conversation_on_its_backend(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim, elsewhere = await start_sim(), await start_sim()
    first = (
        await client.post(sim.url + "/v1/responses", json={"input": "A long question " * 20})
    ).json()
    follow_up = {"input": "And then?", "previous_response_id": first["id"]}
    second = (await client.post(sim.url + "/v1/responses", json=follow_up)).json()
    assert second["previous_response_id"] == first["id"]
    first_prompt = first["usage"]["input_tokens"]
    # The previous conversation, its answer and the new input: a longer prompt whose start
    # the prefix cache holds from the first request.
    assert second["usage"]["input_tokens"] > first_prompt + 16
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first_prompt - 16

    wrong_backend = await client.post(elsewhere.url + "/v1/responses", json=follow_up)
    assert wrong_backend.status_code == 404
    assert (
        wrong_backend.json()["error"]["message"] == f"Response with id '{first['id']}' not found."
    )
    assert elsewhere.app.engine.prompt_tokens_total == 0


async def test_a_background_response_can_be_cancelled_while_it_runs(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(inter_token_latency=0.05)
    body = {"input": "Take your time.", "background": True, "max_output_tokens": 1000}
    queued = (await client.post(sim.url + "/v1/responses", json=body)).json()
    assert (queued["status"], queued["background"], queued["output"]) == ("queued", True, [])
    engine = sim.app.engine
    await engine.wait_until(lambda: engine.running == 1)
    cancel = f"{sim.url}/v1/responses/{queued['id']}/cancel"
    cancelled = (await client.post(cancel)).json()
    assert cancelled["status"] == "cancelled"
    await engine.wait_until(lambda: engine.running == 0)  # its slot freed at once
    item = f"{sim.url}/v1/responses/{queued['id']}"
    assert (await client.get(item)).json()["status"] == "cancelled"

    fast = await start_sim()
    done = (
        await client.post(fast.url + "/v1/responses", json={**body, "max_output_tokens": 2})
    ).json()
    url = f"{fast.url}/v1/responses/{done['id']}"

    async def completed() -> bool:
        return bool((await client.get(url)).json()["status"] == "completed")

    await wait_until(completed)
    refused = await client.post(url + "/cancel")
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "Cannot cancel a synchronous response."
    assert (await client.post(f"{fast.url}/v1/responses/resp_none/cancel")).status_code == 404
    no_store = {**body, "store": False}
    assert (await client.post(fast.url + "/v1/responses", json=no_store)).status_code == 400


def test_the_response_store_keeps_the_most_recently_used() -> None:
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, ()))
    assert store.get("a") is not None  # now the most recently used
    store.put("c", StoredResponse({"id": "c"}, ()))
    assert (store.get("b"), len(store)) == (None, 2)
    assert store.pop("a") is not None and store.get("a") is None


# --- Anthropic's Messages API ------------------------------------------------------------------


async def test_messages_whole_and_streamed_in_vllms_shapes(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    body = {
        "model": MODEL,
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi."}]}],
    }
    whole = (await client.post(sim.url + "/v1/messages", json=body)).json()
    assert whole["id"].startswith("chatcmpl-")  # vLLM answers under the chat completion's id
    assert (whole["type"], whole["role"], whole["model"]) == ("message", "assistant", MODEL)
    assert whole["stop_reason"] == "end_turn" and "stop_sequence" not in whole
    (block,) = whole["content"]
    assert block["type"] == "text" and len(block["text"].split()) == 16
    assert whole["usage"]["output_tokens"] == 16 and whole["usage"]["input_tokens"] > 0

    short = {**body, "max_tokens": 2, "stream": True}
    async with client.stream("POST", sim.url + "/v1/messages", json=short) as response:
        events = await named_events(response)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(name == data["type"] for name, data in events)
    start = events[0][1]["message"]
    assert start["usage"] == {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}
    assert events[5][1]["delta"] == {"stop_reason": "max_tokens"}
    assert events[5][1]["usage"]["output_tokens"] == 2

    counted = await client.post(sim.url + "/v1/messages/count_tokens", json=body)
    assert counted.json() == {"input_tokens": whole["usage"]["input_tokens"]}
    unknown = await client.post(sim.url + "/v1/messages", json={**body, "model": "other"})
    assert (unknown.status_code, unknown.json()) == (
        404,
        {
            "type": "error",
            "error": {"type": "NotFoundError", "message": "The model `other` does not exist."},
        },
    )
    # A body that fails validation is vLLM's OpenAI-shaped 400, before the endpoint runs.
    invalid = await client.post(sim.url + "/v1/messages", json={**body, "max_tokens": 0})
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "max_tokens"


async def test_anthropic_sdk_creates_and_streams_messages(start_sim: StartSim) -> None:
    sim = await start_sim()

    def talk() -> tuple[str, str, str, int]:
        sdk = anthropic.Anthropic(base_url=sim.url, api_key="unused", max_retries=0)
        messages: Any = [{"role": "user", "content": "Hello."}]
        whole = sdk.messages.create(model=MODEL, max_tokens=1024, messages=messages)
        with sdk.messages.stream(model=MODEL, max_tokens=1024, messages=messages) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        try:
            sdk.messages.create(model="other", max_tokens=5, messages=messages)
        except anthropic.NotFoundError as error:
            not_found = error.status_code
        text = whole.content[0].text  # type: ignore[union-attr]
        return text, streamed, final.stop_reason or "", not_found

    text, streamed, stop_reason, not_found = await trio.to_thread.run_sync(talk)
    assert text == streamed and len(text.split()) == 16
    assert (stop_reason, not_found) == ("end_turn", 404)


# --- faults and tracing -------------------------------------------------------------------------


async def test_faults_apply_to_the_new_endpoints(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(error_rate=1.0)
    requests = {
        "/v1/responses": {"input": "x"},
        "/v1/embeddings": {"input": "x"},
        "/rerank": {"query": "x", "documents": ["y"]},
    }
    for path, body in requests.items():
        response = await client.post(sim.url + path, json=body)
        assert (response.status_code, response.json()["error"]["type"]) == (
            500,
            "InternalServerError",
        )
    messages = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    failed = (await client.post(sim.url + "/v1/messages", json=messages)).json()
    assert failed["type"] == "error" and failed["error"]["type"] == "InternalServerError"

    await set_faults(client, sim.url, error_rate=0.0, close_mid_stream=True)
    received: list[str] = []
    body = {"input": "x", "stream": True, "max_output_tokens": 10}
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", sim.url + "/v1/responses", json=body) as response:
            async for line in response.aiter_lines():
                received.append(line)
    assert received.count("event: response.output_text.delta") == 2
    assert "event: response.completed" not in received

    await set_faults(client, sim.url, close_mid_stream=False, hang=True)
    with pytest.raises(httpx.ReadTimeout):
        await client.post(sim.url + "/v1/embeddings", json={"input": "x"}, timeout=0.3)


async def test_the_traceparent_of_each_request_is_kept(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    headers = {"traceparent": traceparent}
    await client.post(sim.url + "/v1/responses", json={"input": "x"}, headers=headers)
    await client.post(
        sim.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    state = (await client.get(sim.url + "/sim/state")).json()
    assert state["traceparents"] == [traceparent]
    assert state["stored_responses"] == 1
