"""Simulated backends as the tests set them up and read them: an engine of one sequence whose
second request waits in its queue, vLLM's 404 for a model it does not serve, the events of a
server-sent stream, the samples of its Prometheus text, and a vLLM prefill leg's ask (the
proxy's own).
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from app.proxy.leg_bodies import PREFILL_TRANSFER_ASK
from app.sim.settings import SimSettings
from tests.conftest import SimHandle

# One sequence at a time, slow enough that a second request is still waiting when a test looks.
QUEUEING = SimSettings(
    port=0,
    max_num_seqs=1,
    prefill_overhead=0.001,
    prefill_per_token=0.0,
    inter_token_latency=0.05,
)
# Eight sequences, each token at once: answers that take no time worth waiting for.
QUICK = dataclasses.replace(QUEUEING, inter_token_latency=0.001, max_num_seqs=8)
LONG_CHAT = {"messages": [{"role": "user", "content": "Keep talking."}], "max_tokens": 1000}
# What the proxy asks a vLLM prefill engine for: hold the KV for a decode.
KV_TRANSFER_ASK = PREFILL_TRANSFER_ASK

# What vLLM answers for a model it does not serve (vllm/entrypoints/openai/models/serving.py,
# `OpenAIModelRegistry.check_model`, through `create_error_response`).
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


async def one_running_one_waiting(
    nursery: trio.Nursery, client: httpx.AsyncClient, sim: SimHandle
) -> None:
    """Two long chats to an engine of one sequence, sent from `nursery`: back once one runs and
    the other waits in the engine's queue."""
    for _ in range(2):
        nursery.start_soon(partial(client.post, sim.url + "/v1/chat/completions", json=LONG_CHAT))
    engine = sim.app.engine
    with trio.fail_after(5):
        await engine.wait_until(lambda: (engine.running, engine.waiting) == (1, 1))
