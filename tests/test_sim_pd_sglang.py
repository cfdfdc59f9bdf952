"""Simulated prefill and decode engines in SGLang's flow, over real HTTP (127.0.0.1, port 0):
both legs sent at once with the same bootstrap fields, as a proxy would; the prefill's
bootstrap server on a port of its own, reported by `/get_server_info`; the decode waits for
its room (counted waiting meanwhile), takes the KV and decodes, streamed or not, batched
(arrays) or not; a room that never comes is a 500, a room never taken expires on the
prefill, a decode without bootstrap fields prefills locally and counts it, and an engine
that does both ignores them.
"""

from __future__ import annotations

import json
import random
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import FAST_SIM, MODEL, SimHandle, StartSim
from tests.sims import samples

PROMPT = "Explain the bootstrap server. " * 20
COMPLETION = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6}


async def pd_pair(start_sim: StartSim, **overrides: Any) -> tuple[SimHandle, SimHandle]:
    prefill = await start_sim(
        FAST_SIM, role="prefill", pd_protocol="sglang", bootstrap_port=0, **overrides
    )
    decode = await start_sim(FAST_SIM, role="decode", pd_protocol="sglang", **overrides)
    return prefill, decode


def bootstrap(prefill: SimHandle, batch: int | None = None) -> dict[str, Any]:
    """The fields a proxy adds to both legs: one room, or arrays as long as the batch."""
    port = prefill.app.pd.bootstrap_port
    if batch is None:
        return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port,
                "bootstrap_room": random.getrandbits(63)}  # fmt: skip
    return {
        "bootstrap_host": ["127.0.0.1"] * batch,
        "bootstrap_port": [port] * batch,
        "bootstrap_room": [random.getrandbits(63) for _ in range(batch)],
    }


async def both_legs(
    client: httpx.AsyncClient,
    prefill: SimHandle,
    decode: SimHandle,
    path: str,
    body: dict[str, Any],
) -> tuple[httpx.Response, bytes]:
    """The same body to both engines at once, the decode's sent first: (prefill's answer, the
    decode's status and body)."""
    answers: dict[str, Any] = {}

    async def send(name: str, url: str) -> None:
        async with client.stream("POST", url + path, json=body) as response:
            answers[name] = (response, await response.aread())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, "decode", decode.url)
        await trio.lowlevel.checkpoint()
        nursery.start_soon(send, "prefill", prefill.url)
    prefill_answer, _ = answers["prefill"]
    return prefill_answer, answers["decode"]


def last_usage(path: str, body: bytes, stream: bool) -> dict[str, Any]:
    if not stream:
        usage: dict[str, Any] = json.loads(body)["usage"]
        return usage
    chunks = [
        json.loads(line.removeprefix("data: "))
        for line in body.decode().splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    return dict(chunks[-1]["usage"])


async def test_the_prefill_reports_its_bootstrap_server(start_sim: StartSim) -> None:
    prefill, decode = await pd_pair(start_sim)
    async with httpx.AsyncClient(trust_env=False) as client:
        about = (await client.get(prefill.url + "/get_server_info")).json()
        decode_about = (await client.get(decode.url + "/get_server_info")).json()
    assert about["disaggregation_mode"] == "prefill"
    assert about["disaggregation_bootstrap_port"] == prefill.app.pd.bootstrap_port > 0
    assert decode_about["disaggregation_mode"] == "decode"
    assert decode.app.pd.bootstrap_port is None  # only prefill engines run one


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_decode_waits_for_its_room_and_recomputes_nothing(
    start_sim: StartSim, client: httpx.AsyncClient, path: str, body: dict[str, Any], stream: bool
) -> None:
    prefill, decode = await pd_pair(start_sim)
    request = body | bootstrap(prefill) | {"stream": stream}
    if stream:
        request["stream_options"] = {"include_usage": True}
    prefill_answer, (decoded, decoded_body) = await both_legs(
        client, prefill, decode, path, request
    )
    assert prefill_answer.status_code == decoded.status_code == 200
    usage = last_usage(path, decoded_body, stream)
    assert usage["completion_tokens"] == 6
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert last_usage(path, prefill_answer.content, stream)["completion_tokens"] == 1
    assert decode.app.pd.counters.recomputed_requests == {"no_params": 0, "unusable": 0}
    assert decode.app.pd.counters.transfers["decode"] == 1
    assert prefill.app.pd.counters.transfers["prefill"] == 1
    assert len(prefill.app.pd.held) == 0 and prefill.app.engine.kv_cache.used_blocks == 0


async def test_a_decode_waiting_for_its_room_counts_as_waiting(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    prefill, decode = await pd_pair(start_sim)
    engine = decode.app.engine
    request = COMPLETION | bootstrap(prefill)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(client.post, decode.url + "/v1/completions", json=request))
        with trio.fail_after(5):
            await decode.app.pd.wait_until(lambda: engine.waiting == 1)
        values = await samples(client, decode.url)
        assert values["vllm:num_requests_waiting"] == 1
        await client.post(prefill.url + "/v1/completions", json=request)
    assert engine.waiting == 0 and decode.app.pd.counters.transfers["decode"] == 1


async def test_a_batch_of_one_carries_arrays_of_rooms(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    prefill, decode = await pd_pair(start_sim)
    request = COMPLETION | {"prompt": [PROMPT]} | bootstrap(prefill, batch=1)
    _, (decoded, body) = await both_legs(client, prefill, decode, "/v1/completions", request)
    assert decoded.status_code == 200
    usage = json.loads(body)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert decode.app.pd.counters.transfers["decode"] == 1


async def test_a_room_that_never_comes_is_a_500(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    prefill, decode = await pd_pair(start_sim, kv_transfer_timeout=0.1)
    for fields in (bootstrap(prefill), bootstrap(prefill) | {"bootstrap_port": 1}):
        answer = await client.post(decode.url + "/v1/completions", json=COMPLETION | fields)
        assert answer.status_code == 500
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "InternalServerError"
    assert decode.app.engine.running == 0 and decode.app.engine.kv_cache.used_blocks == 0
    assert decode.app.pd.counters.transfers["decode"] == 0


async def test_a_room_never_taken_expires_on_the_prefill(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    prefill, _ = await pd_pair(start_sim, kv_transfer_timeout=0.05)
    answer = await client.post(
        prefill.url + "/v1/completions", json=COMPLETION | bootstrap(prefill)
    )
    assert answer.json()["usage"]["completion_tokens"] == 1
    held = prefill.app.pd.held
    with trio.fail_after(5):
        await prefill.app.pd.wait_until(lambda: len(held) == 0)
    assert prefill.app.engine.kv_cache.used_blocks == 0
    assert prefill.app.pd.counters.transfers["prefill"] == 0


async def test_without_bootstrap_fields_the_decode_prefills_locally(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    _, decode = await pd_pair(start_sim)
    answer = (await client.post(decode.url + "/v1/chat/completions", json=CHAT)).json()
    assert answer["usage"]["completion_tokens"] == 6
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    counters = decode.app.pd.counters
    assert counters.recomputed_requests == {"no_params": 1, "unusable": 0}
    assert counters.recomputed_tokens["no_params"] == answer["usage"]["prompt_tokens"]


async def test_an_engine_that_does_both_ignores_the_bootstrap_fields(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    prefill, _ = await pd_pair(start_sim)
    both = await start_sim(FAST_SIM, pd_protocol="sglang")
    answer = await client.post(both.url + "/v1/completions", json=COMPLETION | bootstrap(prefill))
    assert answer.json()["usage"]["completion_tokens"] == 6
    assert len(prefill.app.pd.held) == len(both.app.pd.held) == 0
    about = (await client.get(both.url + "/get_server_info")).json()
    assert about["disaggregation_mode"] == "null"
