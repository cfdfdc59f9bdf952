"""Simulated prefill and decode engines in vLLM's flow, over real HTTP (127.0.0.1, port 0),
driven by hand-made two-leg requests as a proxy would send them: completions, chat and
Responses, streamed and not, with httpx and the `openai` SDK. The prefill answers one token
and the `kv_transfer_params` that name its held blocks; the decode pulls them (which releases
them there), reports the whole prompt cached and recomputes nothing. Without params, or with
params it cannot use (another engine's, expired), the decode prefills locally and counts it.
An engine that does both ignores the params. A client leaving either engine frees it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import openai
import pytest
import trio

from app.sim.settings import MetricsStyle
from tests.conftest import FAST_SIM, MODEL, SimHandle, StartSim
from tests.sims import KV_TRANSFER_ASK

PROMPT = "Tell me about disaggregated serving. " * 20
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL, "prompt": PROMPT, "max_tokens": 6},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 6,
    },
    "/v1/responses": {"model": MODEL, "input": PROMPT, "max_output_tokens": 6},
}
LIMITS = {
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/responses": ("max_output_tokens",),
}


def prefill_leg(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body a proxy sends the prefill engine (pd_contract.md)."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    return (
        leg
        | dict.fromkeys(LIMITS[path], 1)
        | {"stream": False, "kv_transfer_params": KV_TRANSFER_ASK}
    )


async def pd_pair(start_sim: StartSim, **overrides: Any) -> tuple[SimHandle, SimHandle]:
    prefill = await start_sim(FAST_SIM, role="prefill", **overrides)
    decode = await start_sim(FAST_SIM, role="decode", **overrides)
    return prefill, decode


def usage_of(path: str, answer: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of an answer in its endpoint's shape."""
    usage = answer["usage"]
    if path == "/v1/responses":
        cached = usage["input_tokens_details"]["cached_tokens"]
        return usage["input_tokens"], usage["output_tokens"], cached
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens"], usage["completion_tokens"], cached


async def streamed_answer(response: httpx.Response, path: str) -> dict[str, Any]:
    """The usage-bearing end of a stream: the last chunk, or `response.completed`'s."""
    assert response.status_code == 200
    last: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            last = json.loads(line.removeprefix("data: "))
    return last["response"] if path == "/v1/responses" else last


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [False, True])
async def test_the_decode_takes_the_prefills_kv_and_recomputes_nothing(
    start_sim: StartSim, client: httpx.AsyncClient, path: str, stream: bool
) -> None:
    prefill, decode = await pd_pair(start_sim)
    body = BODIES[path] | {"stream": stream}
    if stream and path != "/v1/responses":
        body["stream_options"] = {"include_usage": True}
    headers = {"X-Request-Id": f"req-{path}-{stream}"}

    first = await client.post(prefill.url + path, json=prefill_leg(path, body), headers=headers)
    assert first.status_code == 200
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == prefill.app.pd.engine_id
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.port)
    assert params["remote_block_ids"] and params["tp_size"] == 1
    prompt_tokens, one, _ = usage_of(path, first.json())
    assert one == 1 and len(prefill.app.pd.held) == 1
    assert prefill.app.engine.kv_cache.used_blocks == len(params["remote_block_ids"])

    second = body | {"kv_transfer_params": params}
    async with client.stream("POST", decode.url + path, json=second, headers=headers) as answer:
        if stream:
            final = await streamed_answer(answer, path)
        else:
            await answer.aread()
            final = answer.json()
    assert "kv_transfer_params" not in final
    assert usage_of(path, final) == (prompt_tokens, 6, prompt_tokens)  # cached: all of it
    assert decode.app.pd.counters.recomputed_requests == {"no_params": 0, "unusable": 0}
    assert decode.app.pd.counters.transfers["decode"] == 1
    assert prefill.app.pd.counters.transfers["prefill"] == 1
    assert len(prefill.app.pd.held) == 0 and prefill.app.engine.kv_cache.used_blocks == 0


async def test_the_openai_sdk_carries_the_params_through_both_legs(start_sim: StartSim) -> None:
    prefill, decode = await pd_pair(start_sim)
    headers = {"X-Request-Id": "sdk-1"}
    messages = BODIES["/v1/chat/completions"]["messages"]
    async with openai.AsyncOpenAI(base_url=prefill.url + "/v1", api_key="-", max_retries=0) as p:
        first = await p.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=1,
            extra_body={"kv_transfer_params": KV_TRANSFER_ASK},
            extra_headers=headers,
        )
    params = (first.model_extra or {})["kv_transfer_params"]
    async with openai.AsyncOpenAI(base_url=decode.url + "/v1", api_key="-", max_retries=0) as d:
        stream = await d.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"kv_transfer_params": params},
            extra_headers=headers,
        )
        chunks = [chunk async for chunk in stream]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 5
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens
    assert decode.app.pd.counters.recomputed_requests == {"no_params": 0, "unusable": 0}


async def test_a_decode_without_usable_params_prefills_locally_and_counts_why(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    prefill, decode = await pd_pair(start_sim)
    path, body = "/v1/completions", BODIES["/v1/completions"]
    plain = await client.post(decode.url + path, json=body)
    prompt_tokens, completion, cached = usage_of(path, plain.json())
    assert (completion, cached) == (6, 0)

    first = await client.post(
        prefill.url + path, json=prefill_leg(path, body), headers={"X-Request-Id": "mine"}
    )
    params = first.json()["kv_transfer_params"]
    unusable = [
        ({"X-Request-Id": "someone-else"}, params),
        ({"X-Request-Id": "mine"}, params | {"remote_engine_id": "sim-other"}),
        ({"X-Request-Id": "mine"}, params | {"remote_port": "not a port"}),
    ]
    for headers, wrong in unusable:
        answer = await client.post(
            decode.url + path, json=body | {"kv_transfer_params": wrong}, headers=headers
        )
        assert answer.status_code == 200 and usage_of(path, answer.json())[1] == 6

    counters = decode.app.pd.counters
    assert counters.recomputed_requests == {"no_params": 1, "unusable": 3}
    assert counters.recomputed_tokens == {"no_params": prompt_tokens, "unusable": 3 * prompt_tokens}
    assert counters.transfers["decode"] == 0
    assert len(prefill.app.pd.held) == 1  # still there for its own decode, or its expiry


async def test_held_kv_expires_and_a_late_decode_recomputes(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    prefill, decode = await pd_pair(start_sim, kv_transfer_timeout=0.05)
    path, body = "/v1/completions", BODIES["/v1/completions"]
    headers = {"X-Request-Id": "late"}
    first = await client.post(prefill.url + path, json=prefill_leg(path, body), headers=headers)
    held = prefill.app.pd.held
    with trio.fail_after(5):
        await prefill.app.pd.wait_until(lambda: len(held) == 0)
    assert prefill.app.engine.kv_cache.used_blocks == 0  # expired blocks are released
    answer = await client.post(
        decode.url + path,
        json=body | {"kv_transfer_params": first.json()["kv_transfer_params"]},
        headers=headers,
    )
    assert usage_of(path, answer.json())[2] == 0
    assert decode.app.pd.counters.recomputed_requests["unusable"] == 1
    assert prefill.app.pd.counters.transfers["prefill"] == 0


async def test_an_engine_that_does_both_ignores_the_params(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    both = await start_sim(FAST_SIM)
    path = "/v1/chat/completions"
    body = prefill_leg(path, BODIES[path])
    answer = (await client.post(both.url + path, json=body)).json()
    assert "kv_transfer_params" not in answer and usage_of(path, answer)[1] == 1
    assert len(both.app.pd.held) == 0 and both.app.engine.kv_cache.used_blocks == 0
    decoded = await client.post(both.url + path, json=BODIES[path] | {"kv_transfer_params": {}})
    assert usage_of(path, decoded.json())[1] == 6
    assert both.app.pd.counters.recomputed_requests == {"no_params": 0, "unusable": 0}


async def leave_while_running(
    client: httpx.AsyncClient, engine: SimHandle, body: dict[str, Any], request_id: str
) -> None:
    """Send a request, go away once the engine runs it, and see the engine freed."""
    sim = engine.app.engine
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            headers = {"X-Request-Id": request_id}
            await client.post(engine.url + "/v1/completions", json=body, headers=headers)

        nursery.start_soon(send)
        with trio.fail_after(5):
            await sim.wait_until(lambda: sim.running == 1)
        nursery.cancel_scope.cancel()
    with trio.fail_after(5):
        await sim.wait_until(lambda: sim.running == 0)
    assert sim.kv_cache.used_blocks == 0


async def test_a_client_leaving_either_engine_frees_it(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    slow = dataclasses.replace(FAST_SIM, inter_token_latency=0.05, prefill_per_token=0.01)
    prefill = await start_sim(slow, role="prefill")
    decode = await start_sim(slow, role="decode", kv_transfer_per_token=0.0)
    path = "/v1/completions"
    short = BODIES[path] | {"prompt": "short"}
    first = await client.post(
        prefill.url + path, json=prefill_leg(path, short), headers={"X-Request-Id": "gone"}
    )
    params = first.json()["kv_transfer_params"]
    long_answer = {"max_tokens": 1000, "stream": True}
    await leave_while_running(
        client, decode, short | long_answer | {"kv_transfer_params": params}, "gone"
    )
    assert decode.app.pd.counters.transfers["decode"] == 1
    # Left while its long prompt is computed: nothing is held for a decode.
    await leave_while_running(client, prefill, prefill_leg(path, BODIES[path]), "leaving")
    assert len(prefill.app.pd.held) == 0


@pytest.mark.parametrize("style", ["vllm", "sglang", "llamacpp", "tgi"])
async def test_the_counters_are_in_every_metrics_style(
    start_sim: StartSim, client: httpx.AsyncClient, style: MetricsStyle
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    decode = await start_sim(FAST_SIM, role="decode", metrics_style=style)
    body = BODIES["/v1/completions"]
    prompt_tokens = usage_of(
        "/v1/completions", (await client.post(decode.url + "/v1/completions", json=body)).json()
    )[0]
    text = (await client.get(decode.url + "/metrics")).text
    values = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    no_params, unusable = (("reason", "no_params"),), (("reason", "unusable"),)
    assert values["sluice_sim_pd_recomputed_requests_total", no_params] == 1
    assert values["sluice_sim_pd_recomputed_requests_total", unusable] == 0
    assert values["sluice_sim_pd_recomputed_tokens_total", no_params] == prompt_tokens
    assert values["sluice_sim_pd_transfers_total", (("role", "decode"),)] == 0
    assert values["sluice_sim_pd_transfers_total", (("role", "prefill"),)] == 0
    assert values["sim:pd_recomputed_prompts_total", ()] == 1
    assert values["sim:pd_transfers_total", ()] == 0
