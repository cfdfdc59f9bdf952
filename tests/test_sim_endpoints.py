"""The simulated backend's paths over real HTTP (`start_sim`, port 0): unknown paths and methods
(FastAPI's `{"detail": "Not Found"}`, as vLLM answers), unknown models on every endpoint that
names one, the faults on the endpoints beside chat and completions, and the traceparents
/sim/state keeps. Each endpoint family has its own file: test_sim_pooling.py,
test_sim_transcriptions.py, test_sim_responses.py, test_sim_messages.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import MODEL, StartSim, set_faults
from tests.sims import UNKNOWN_MODEL

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
