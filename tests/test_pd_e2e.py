"""Disaggregated serving end to end: a Sluice in front of simulated prefill and decode
engines on 127.0.0.1, in vLLM's flow and SGLang's, streamed and not, through the `openai`
SDK too. What is checked is what the engines saw (the decode engines' recompute counters,
the transfers) and what the client got (two hops or one and why, usage as the prefill
computed it, answers shaped as an aggregated engine's)."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import FAST_SIM, MODEL, SimHandle, StartSim, StartSluice
from tests.sims import samples

LONG = {"role": "user", "content": "tell me " + "about the sea " * 300}


def long_chat(topic: str) -> dict[str, Any]:
    """A long prompt of its own: a decode engine holds the prompts transferred to it, so the
    same prompt again would be short there (one hop)."""
    content = f"tell me about {topic} " + "and then some more " * 300
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


SHORT = {"role": "user", "content": "hi"}
PD_SIM = dataclasses.replace(FAST_SIM, max_num_seqs=8)


async def pd_fleet(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, protocol: str
) -> tuple[str, str, str]:
    """(proxy URL, prefill URL, decode URL) of a Sluice in front of one of each."""
    prefill = await start_sim(PD_SIM, role="prefill", pd_protocol=protocol, bootstrap_port=0)
    decode = await start_sim(PD_SIM, role="decode", pd_protocol=protocol)
    entry = prefill.url
    if protocol == "sglang":
        info = (await client.get(prefill.url + "/get_server_info")).json()
        entry += f"={info['disaggregation_bootstrap_port']}"
    sluice = await start_sluice(
        [], prefill=(entry,), decode=(decode.url,), pd_protocol=protocol, disaggregate_above=64
    )
    return sluice.proxy_url, prefill.url, decode.url


async def vllm_fleet(
    start_sim: StartSim, start_sluice: StartSluice, prefills: int, decodes: int
) -> tuple[str, list[SimHandle], list[SimHandle]]:
    """(proxy URL, prefill engines, decode engines) of vLLM's flow."""
    prefill = [await start_sim(PD_SIM, role="prefill") for _ in range(prefills)]
    decode = [await start_sim(PD_SIM, role="decode") for _ in range(decodes)]
    sluice = await start_sluice(
        [],
        prefill=tuple(sim.url for sim in prefill),
        decode=tuple(sim.url for sim in decode),
        disaggregate_above=64,
    )
    return sluice.proxy_url, prefill, decode


async def recomputed(client: httpx.AsyncClient, url: str) -> float:
    return (await samples(client, url)).get("sim:pd_recomputed_prompts_total", 0.0)


async def transfers(client: httpx.AsyncClient, url: str) -> float:
    return (await samples(client, url)).get("sim:pd_transfers_total", 0.0)


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_long_prompt_takes_two_hops_and_the_decode_recomputes_nothing(
    start_sim: StartSim,
    start_sluice: StartSluice,
    client: httpx.AsyncClient,
    protocol: str,
    stream: bool,
) -> None:
    proxy, prefill, decode = await pd_fleet(start_sim, start_sluice, client, protocol)
    body: dict[str, Any] = {"model": MODEL, "messages": [LONG], "max_tokens": 8}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    answer = await client.post(proxy + "/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-sluice-pd"] == "disaggregated"
    assert answer.headers["x-sluice-prefill"] == prefill
    assert answer.headers["x-sluice-backend"] == decode
    assert await recomputed(client, decode) == 0
    assert await transfers(client, decode) == 1
    assert '"cached_tokens":0' in answer.text.replace(" ", "")  # the prefill's: a cold cache


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses"])
async def test_completions_and_responses_take_two_hops_too(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, path: str
) -> None:
    proxy, _, decode = await pd_fleet(start_sim, start_sluice, client, "vllm")
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8}
    if path == "/v1/completions":
        body["prompt"] = LONG["content"]
    else:
        body = {"model": MODEL, "input": LONG["content"], "max_output_tokens": 8}
    answer = await client.post(proxy + path, json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-sluice-pd"] == "disaggregated"
    assert await recomputed(client, decode) == 0


async def test_short_prompts_and_several_choices_take_one_hop(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    proxy, prefill, _ = await pd_fleet(start_sim, start_sluice, client, "vllm")
    short = {"model": MODEL, "messages": [SHORT], "max_tokens": 4}
    answer = await client.post(proxy + "/v1/chat/completions", json=short)
    assert answer.headers["x-sluice-pd"] == "aggregated (short)"
    several = {"model": MODEL, "messages": [LONG], "max_tokens": 4, "n": 2}
    answer = await client.post(proxy + "/v1/chat/completions", json=several)
    assert answer.headers["x-sluice-pd"] == "aggregated (n>1)"
    assert await transfers(client, prefill) == 0  # no prefill leg ran
    metrics = await samples(client, proxy)
    assert metrics.get("sluice_pd_prefill_seconds_count", 0) == 0


async def test_an_engine_that_names_no_transfer_sends_the_request_one_hop(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    """A "prefill" engine without a KV connector answers the request as any other."""
    plain = await start_sim(PD_SIM)
    decode = await start_sim(PD_SIM, role="decode")
    sluice = await start_sluice([], prefill=(plain.url,), decode=(decode.url,))
    body = {"model": MODEL, "messages": [LONG], "max_tokens": 4}
    answer = await client.post(sluice.proxy_url + "/v1/chat/completions", json=body)
    assert answer.status_code == 200
    assert answer.headers["x-sluice-pd"] == "aggregated (no transfer)"
    exposition = (await client.get(sluice.proxy_url + "/metrics")).text
    counted = 'sluice_pd_requests_total{mode="aggregated",model="m",reason="no transfer"} 1.0'
    assert counted in exposition


@pytest.mark.parametrize("stream", [False, True])
async def test_through_the_openai_sdk_answers_look_like_an_aggregated_engines(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient, stream: bool
) -> None:
    proxy, _, decode = await pd_fleet(start_sim, start_sluice, client, "vllm")
    whole = await start_sim(PD_SIM)
    answers = []
    for base in (proxy, whole.url):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x") as sdk:
            if stream:
                chunks = await sdk.chat.completions.create(
                    model=MODEL,
                    messages=[LONG],
                    max_tokens=6,
                    stream=True,  # type: ignore[list-item]
                    stream_options={"include_usage": True},
                )
                answers.append([chunk.model_dump() async for chunk in chunks])
            else:
                made = await sdk.chat.completions.create(
                    model=MODEL,
                    messages=[LONG],
                    max_tokens=6,  # type: ignore[list-item]
                )
                answers.append(made.model_dump())
    assert _shape(answers[0]) == _shape(answers[1])
    assert await recomputed(client, decode) == 0


def _shape(value: Any) -> Any:
    """A JSON value's keys and types, not its contents."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape(item) for item in value]
    return type(value).__name__


async def test_a_dead_prefill_engine_is_passed_over_then_the_decode_prefills_itself(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    proxy, (first, second), (decode,) = await vllm_fleet(start_sim, start_sluice, 2, 1)
    first.kill()  # before its health check notices: the leg itself finds it gone
    answer = await client.post(proxy + "/v1/chat/completions", json=long_chat("a"))
    assert answer.status_code == 200
    assert answer.headers["x-sluice-pd"] == "disaggregated"
    assert answer.headers["x-sluice-prefill"] == second.url
    second.kill()
    answer = await client.post(proxy + "/v1/chat/completions", json=long_chat("b"))
    assert answer.status_code == 200
    assert answer.headers["x-sluice-pd"] in (
        "aggregated (prefill failed)",
        "aggregated (no prefill engine)",
    )
    assert answer.headers["x-sluice-backend"] == decode.url


async def test_a_dead_decode_engine_is_passed_over_with_a_fresh_prefill(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    proxy, _, (first, second) = await vllm_fleet(start_sim, start_sluice, 1, 2)
    first.kill()
    for topic in ("a", "b"):  # whichever decode engine the first choice is
        body = long_chat(topic)
        answer = await client.post(proxy + "/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sluice-pd"] == "disaggregated"
        assert answer.headers["x-sluice-backend"] == second.url
    assert await recomputed(client, second.url) == 0


async def test_sglang_a_prefill_that_fails_cancels_its_decode_at_once(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    proxy, prefill, decode = await pd_fleet(start_sim, start_sluice, client, "sglang")
    await client.post(prefill + "/sim/faults", json={"error_rate": 1.0})
    body = {"model": MODEL, "messages": [LONG], "max_tokens": 4}
    answer = await client.post(proxy + "/v1/chat/completions", json=body)
    # No prefill engine is left and none serves requests whole: an error of Sluice's own,
    # at once, not after the decode engine's wait for its room.
    assert answer.status_code == 502, answer.text
    running = (await samples(client, decode)).get("vllm:num_requests_running", 0.0)
    assert running == 0
