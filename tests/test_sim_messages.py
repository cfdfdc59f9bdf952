"""The simulated backend's Anthropic `/v1/messages` over real HTTP (`start_sim`, port 0): whole
and streamed in vLLM's shapes, `count_tokens`, the 404 and 400 answers, and the official
`anthropic` SDK's messages.create and messages.stream.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import trio

from tests.conftest import MODEL, StartSim
from tests.sims import named_events

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
