"""The simulated backend's Responses API over real HTTP (`start_sim`, port 0): a response whole,
stored, retrieved and deleted; streamed (event order and sequence numbers); through the
official `openai` SDK; chained by `previous_response_id` (the prompt grows and the prefix cache
serves it, on the backend that stored it only); cancelled in the background; and the store's
least-recently-used bound alone.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from app.sim.response_store import ResponseStore, StoredResponse
from tests.conftest import MODEL, StartSim, wait_until
from tests.sims import named_events

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
