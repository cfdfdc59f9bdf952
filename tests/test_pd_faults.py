"""Disaggregated serving's faults and its vLLM flow end to end, every engine a real
`sluice sim-backend` process (load/processes.py's `Stack`) and Sluice in front of them
(tests/conftest.py's `start_sluice`): a prefill engine SIGKILLed under load costs no request,
each retried on the other prefill engine or served in one hop; a client that leaves
mid-stream releases both engines within a few of the stream's own inter-token gaps (vLLM's
flow and SGLang's), and one that leaves while its prompt is prefilled releases the prefill
engine long before the prefill would have ended and never reaches the decode engine; chat,
completions and Responses through the `openai` SDK, streamed and not, answer as an
aggregated engine of the same seed does, ids aside, every prompt transferred and none
recomputed."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio

from load import harness
from load.processes import Stack, free_port
from tests.conftest import MODEL, StartSluice, wait_until

CHAT_PATH = "/v1/chat/completions"
PROMPT = "Tell me how prefill and decode engines share one request. " * 6  # ~90 tokens
PROMPT_WORDS = len(PROMPT.split())
SLOW_PER_WORD = 0.04  # a prefill of seconds, which a client leaves during
THRESHOLD = 16  # --disaggregate-above: every PROMPT takes two hops
# Coarse steps: the engines are processes on a shared 2-core machine.
TIMING = ("--prefill-overhead", "0.002", "--prefill-per-token", "0.0005",
          "--inter-token-latency", "0.02")  # fmt: skip
# Ids and clocks differ between two answers; the rest must not (tests/test_endpoints_sdks.py).
VOLATILE = re.compile(
    r'"(id|created|created_at|item_id|system_fingerprint)":\s*("[^"]*"|\d+(\.\d+)?)'
)
# Each prompt its own: a prompt seen before is cached where it went (it would go one hop).
NONCES = itertools.count()


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with Stack() as processes:
        yield processes


async def engines(
    stack: Stack, role: str, count: int, *flags: str, flow: str = "vllm"
) -> list[str]:
    """`count` sim-backend processes of `role` started at once, seeds 0, 1, ..."""
    urls: dict[int, str] = {}

    async def one(seed: int) -> None:
        urls[seed] = await stack.sim(
            "--seed",
            str(seed),
            "--role",
            role,
            "--pd-protocol",
            flow,
            *TIMING,
            *flags,
            model=MODEL,
        )

    async with trio.open_nursery() as nursery:
        for seed in range(count):
            nursery.start_soon(one, seed)
    return [urls[seed] for seed in range(count)]


async def state(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    reply: dict[str, Any] = (await client.get(url + "/sim/state")).json()
    return reply


async def idle(client: httpx.AsyncClient, url: str) -> bool:
    """The engine runs and queues nothing, and holds no KV for a decode engine."""
    now = await state(client, url)
    return now["running"] == now["waiting"] == now["pd"]["held_transfers"] == 0


def unique_prompt() -> str:
    return f"[{next(NONCES)}] {PROMPT}"


def chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": unique_prompt()}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def answered(client: httpx.AsyncClient, url: str, stream: bool) -> tuple[int, str, bool]:
    """(status, x-sluice-pd, whole): a streamed answer is whole when it ends with [DONE] and
    carries no error event; an unstreamed one when it has its choices."""
    async with client.stream("POST", url + CHAT_PATH, json=chat(8, stream)) as response:
        body = (await response.aread()).decode()
    if response.status_code != 200:
        return response.status_code, "", False
    if stream:
        whole = body.rstrip().endswith("data: [DONE]") and '"error"' not in body
    else:
        whole = bool(json.loads(body)["choices"])
    return response.status_code, response.headers.get("x-sluice-pd", ""), whole


async def test_a_prefill_engine_killed_under_load_loses_no_request(
    stack: Stack, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    # One sequence a prefill engine: a second prefill leg waits in its queue, so when the
    # engine is killed with one waiting, at least one leg is in flight on it.
    prefills = await engines(stack, "prefill", 2, "--max-num-seqs", "1")
    decodes = await engines(stack, "decode", 2)
    running = await start_sluice(
        [], prefill=tuple(prefills), decode=tuple(decodes), disaggregate_above=THRESHOLD
    )
    outcomes: list[tuple[int, str, bool]] = []

    async def one(stream: bool) -> None:
        outcomes.append(await answered(client, running.proxy_url, stream))

    async def queued_on_the_first() -> bool:
        return (await state(client, prefills[0]))["waiting"] >= 1

    sent = 40
    async with trio.open_nursery() as nursery:
        for index in range(sent):
            nursery.start_soon(one, index % 2 == 0)
            if index == sent // 4:
                await wait_until(queued_on_the_first)
                stack.kill(prefills[0])
            await trio.sleep(0.005)  # an open loop's arrivals, not synchronisation

    assert Counter(status for status, _, _ in outcomes) == {200: sent}
    assert all(whole for _, _, whole in outcomes)
    assert {pd for _, pd, _ in outcomes} <= {"disaggregated", "aggregated (prefill failed)"}
    samples = harness.parse_metrics((await client.get(running.proxy_url + "/metrics")).text)
    assert samples['sluice_pd_leg_failures_total{leg="prefill"}'] >= 1  # the kill hit a leg


async def stream_then_leave(
    client: httpx.AsyncClient, url: str, tokens: int
) -> tuple[float, float]:
    """Stream a long chat, leave after `tokens` tokens: (the median gap between them, the
    Trio time of leaving)."""
    seen: list[float] = []
    async with client.stream("POST", url + CHAT_PATH, json=chat(500, True)) as response:
        assert response.status_code == 200
        assert response.headers["x-sluice-pd"] == "disaggregated"
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen.append(trio.current_time())
                if len(seen) == tokens:
                    break
    left = trio.current_time()
    gaps = sorted(b - a for a, b in itertools.pairwise(seen))
    return gaps[len(gaps) // 2], left


@pytest.mark.parametrize("flow", ["vllm", "sglang"])
async def test_a_client_leaving_mid_stream_releases_both_engines(
    stack: Stack, start_sluice: StartSluice, client: httpx.AsyncClient, flow: str
) -> None:
    port = free_port()
    [prefill] = await engines(stack, "prefill", 1, "--bootstrap-port", str(port), flow=flow)
    [decode] = await engines(stack, "decode", 1, flow=flow)
    running = await start_sluice(
        [],
        prefill=(f"{prefill}={port}" if flow == "sglang" else prefill,),
        decode=(decode,),
        pd_protocol=flow,
        disaggregate_above=THRESHOLD,
    )

    gap, left = await stream_then_leave(client, running.proxy_url, tokens=6)

    async def both_idle() -> bool:
        return await idle(client, decode) and await idle(client, prefill)

    await wait_until(both_idle)
    released = trio.current_time() - left
    # Noticed at the next token at the latest, at each of the two hops to the engine, plus
    # the polling's own 10 ms steps: a few gaps (4 of these 20 ms ones are the issue's
    # 100 ms), not the 490 tokens left.
    assert released <= 4 * gap, (released, gap)
    assert (await state(client, decode))["generation_tokens"] < 100


async def test_a_client_leaving_during_its_prefill_releases_it_and_never_reaches_decode(
    stack: Stack, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    [prefill] = await engines(stack, "prefill", 1, "--prefill-per-token", str(SLOW_PER_WORD))
    [decode] = await engines(stack, "decode", 1)
    running = await start_sluice(
        [], prefill=(prefill,), decode=(decode,), disaggregate_above=THRESHOLD
    )
    before = harness.parse_metrics((await client.get(decode + "/metrics")).text)

    async def prefilling() -> bool:
        return (await state(client, prefill))["running"] == 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answered, client, running.proxy_url, True)
        await wait_until(prefilling)
        started = trio.current_time()
        nursery.cancel_scope.cancel()  # the client goes away

    await wait_until(lambda: idle(client, prefill))
    # Released long before its prefill would have ended.
    assert trio.current_time() - started < PROMPT_WORDS * SLOW_PER_WORD / 4
    after = harness.parse_metrics((await client.get(decode + "/metrics")).text)
    for name in ("sim:pd_transfers_total", "sim:pd_recomputed_prompts_total"):
        assert after[name] == before[name]
    assert await idle(client, decode) and (await state(client, decode))["prompt_tokens"] == 0


def message(content: str) -> Any:
    return [{"role": "user", "content": content}]


def without_ids(text: str) -> str:
    return VOLATILE.sub(r'"\1":_', text)


def exercise(base_url: str, prompts: list[str]) -> list[str]:
    """Chat, completions and Responses, each whole and streamed (chat's and completions'
    with usage), through the SDK, each with a prompt of its own: every answer and event as
    JSON, ids removed."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-test", max_retries=0)
    usage: Any = {"include_usage": True}
    chat_, text, responses, chat_streamed, text_streamed, responses_streamed = prompts
    answers = [
        client.chat.completions.create(model=MODEL, messages=message(chat_), max_tokens=6),
        client.completions.create(model=MODEL, prompt=text, max_tokens=6),
        client.responses.create(model=MODEL, input=responses, max_output_tokens=6),
    ]
    streams: list[Any] = [
        client.chat.completions.create(
            model=MODEL,
            messages=message(chat_streamed),
            max_tokens=6,
            stream=True,
            stream_options=usage,
        ),
        client.completions.create(
            model=MODEL, prompt=text_streamed, max_tokens=6, stream=True, stream_options=usage
        ),
        client.responses.create(
            model=MODEL, input=responses_streamed, max_output_tokens=6, stream=True
        ),
    ]
    dumped = [answer.model_dump_json() for answer in answers]
    dumped += [event.model_dump_json() for stream in streams for event in stream]
    return [without_ids(text) for text in dumped]


async def test_the_openai_sdk_gets_aggregated_answers_with_every_prompt_transferred(
    stack: Stack, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    [prefill] = await engines(stack, "prefill", 1)
    [decode] = await engines(stack, "decode", 1)
    [both] = await engines(stack, "both", 1)  # seed 0, as the decode engine: the same text
    disaggregated = await start_sluice(
        [], prefill=(prefill,), decode=(decode,), disaggregate_above=THRESHOLD
    )
    aggregated = await start_sluice([both])

    prompts = [unique_prompt() for _ in range(6)]
    through_two = await trio.to_thread.run_sync(exercise, disaggregated.proxy_url, prompts)
    through_one = await trio.to_thread.run_sync(exercise, aggregated.proxy_url, prompts)

    assert through_two == through_one
    proxy = harness.parse_metrics((await client.get(disaggregated.proxy_url + "/metrics")).text)
    assert harness.label_values(proxy, "sluice_pd_requests_total", "mode") == {"disaggregated": 6}
    engine = harness.parse_metrics((await client.get(decode + "/metrics")).text)
    assert engine["sim:pd_recomputed_prompts_total"] == 0
    assert engine['sluice_sim_pd_transfers_total{role="decode"}'] == 6
