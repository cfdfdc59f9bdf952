"""What the simulated backend's answers look like to a client, shared by the test_sim_*.py
files: vLLM's 404 for a model it does not serve, the events of a server-sent stream, and the
samples of its Prometheus text.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

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
