"""The simulated backend's pooling endpoints over real HTTP (`start_sim`, port 0):
`/v1/embeddings` in floats and base64 (and through the official `openai` SDK), `/rerank`,
`/score`, `/classify` and `/pooling` in vLLM's shapes, on the engine's load model (prompt
tokens counted, none generated); and `/tokenize` read back by `/detokenize`.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import MODEL, StartSim
from tests.sims import samples

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
