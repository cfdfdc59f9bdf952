"""Simulated clients: a gentle, realistic mix of requests for `sluice demo`.

The mix follows seed 000's observation of real traffic: many requests share a few long
system prompts (cache hits), conversations grow turn by turn (prefix hits), and some
questions are one-offs (misses).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

import httpx
import trio

log = logging.getLogger("sluice.traffic")

MAX_CONCURRENT_REQUESTS = 16
MAX_TURNS = 12

SYSTEM_PROMPTS = (
    "You are a careful support agent for a cloud storage company. "
    + "Answer with numbered steps, cite the relevant policy section, and never guess. " * 40,
    "You are a senior Python reviewer. Point out bugs first, then style, then tests. "
    + "Prefer the standard library and explain every suggestion briefly. " * 60,
    "You summarise legal documents for non-lawyers in plain English. "
    + "Flag every obligation, deadline and penalty in a separate list. " * 80,
)
TOPICS = (
    "rate limits",
    "billing",
    "retries",
    "timeouts",
    "quotas",
    "streaming",
    "caching",
    "tokenizers",
    "backpressure",
    "health checks",
    "circuit breakers",
    "KV cache",
)


def _question(rng: random.Random) -> str:
    first, second = rng.choice(TOPICS), rng.choice(TOPICS)
    return f"How do {first} interact with {second} in case {rng.randrange(10**6)}?"


class Conversations:
    """Growing conversations; each request extends one of a few by a turn."""

    def __init__(self, rng: random.Random, count: int = 4) -> None:
        self._rng = rng
        self._histories: list[list[dict[str, str]]] = [self._fresh() for _ in range(count)]

    def _fresh(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self._rng.choice(SYSTEM_PROMPTS)}]

    def next_messages(self) -> list[dict[str, str]]:
        index = self._rng.randrange(len(self._histories))
        history = self._histories[index]
        if len(history) > 2 * MAX_TURNS:
            history = self._histories[index] = self._fresh()
        history.append({"role": "user", "content": _question(self._rng)})
        return list(history)

    def answered(self, messages: list[dict[str, str]], answer: str) -> None:
        for history in self._histories:
            if history == messages:
                history.append({"role": "assistant", "content": answer})
                return


def requests(rng: random.Random, conversations: Conversations) -> Iterator[dict[str, Any]]:
    while True:
        roll = rng.random()
        if roll < 0.5:
            messages = [
                {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                {"role": "user", "content": _question(rng)},
            ]
        elif roll < 0.85:
            messages = conversations.next_messages()
        else:
            messages = [{"role": "user", "content": _question(rng) * rng.randint(1, 20)}]
        yield {
            "model": "demo",
            "messages": messages,
            "max_tokens": rng.randint(8, 48),
            "stream": rng.random() < 0.5,
        }


async def _send(
    client: httpx.AsyncClient, body: dict[str, Any], conversations: Conversations
) -> None:
    try:
        if body["stream"]:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_raw():
                    pass
            return
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code == 200:
            answer = response.json()["choices"][0]["message"]["content"]
            conversations.answered(body["messages"], answer)
    except httpx.HTTPError as exc:
        log.debug("demo request failed: %s", exc)


async def run_traffic(proxy_url: str, rate: float, seed: int = 0) -> None:
    """Send requests with Poisson arrivals at `rate` per second, forever."""
    rng = random.Random(seed)
    conversations = Conversations(rng)
    limiter = trio.CapacityLimiter(MAX_CONCURRENT_REQUESTS)
    # Building a client loads CA certificates (~30 ms, seen by the stall detector): not on the loop.
    client = await trio.to_thread.run_sync(
        lambda: httpx.AsyncClient(base_url=proxy_url, timeout=30, trust_env=False)
    )
    async with client, trio.open_nursery() as nursery:
        for body in requests(rng, conversations):
            await trio.sleep(rng.expovariate(rate))
            if limiter.available_tokens == 0:
                continue

            async def one(body: dict[str, Any] = body) -> None:
                async with limiter:
                    await _send(client, body, conversations)

            nursery.start_soon(one)
