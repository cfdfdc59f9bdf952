"""Simulated clients for `sluice demo`: a gentle, realistic mix, and bursts worth watching.

The mix is real traffic's (app/README.md): some questions come again word for word (exact
hits), many requests share a few long system prompts (prefix hits), conversations grow turn
by turn (prefix hits), and some questions are one-offs (misses).

Every `--demo-burst-interval` seconds, and whenever the dashboard's "send a burst" button
asks, a burst of large unique prompts saturates the tokenizer, so that the fallback, the
queue, the saturation policy and the stall detector all have something to show within
seconds of opening the page.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import trio

from app.errors import UpstreamError
from app.http.fetch import Fetcher

log = logging.getLogger("sluice.traffic")

MAX_CONCURRENT_REQUESTS = 16
REQUEST_TIMEOUT_S = 60.0
MAX_TURNS = 12
BURST_SIZE = 32
BURST_WORDS = 6000
FIRST_BURST_AFTER_S = 5.0
BURST_VOCABULARY = ("latency", "tokenizer", "kernel", "prefix", "batch", "stream", "cache", "GPU")

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


def requests(
    rng: random.Random, conversations: Conversations, models: Sequence[str]
) -> Iterator[dict[str, Any]]:
    """Chat requests, each for one of `models` (the first twice as often as each other)."""
    weights = [2] + [1] * (len(models) - 1)
    while True:
        roll = rng.random()
        if roll < 0.2:
            # The same question asked again, word for word (FAQ bots, retries): L0 hits.
            messages = [
                {"role": "system", "content": SYSTEM_PROMPTS[0]},
                {"role": "user", "content": f"How do {rng.choice(TOPICS[:4])} work?"},
            ]
        elif roll < 0.55:
            messages = [
                {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                {"role": "user", "content": _question(rng)},
            ]
        elif roll < 0.85:
            messages = conversations.next_messages()
        else:
            messages = [{"role": "user", "content": _question(rng) * rng.randint(1, 20)}]
        yield {
            "model": rng.choices(models, weights)[0],
            "messages": messages,
            "max_tokens": rng.randint(8, 48),
            "stream": rng.random() < 0.5,
        }


async def _send(
    client: Fetcher,
    proxy_url: str,
    body: dict[str, Any],
    conversations: Conversations | None,
    path: str = "/v1/chat/completions",
) -> None:
    """One request, its answer read whole (a streamed one too: nobody reads it as it comes)."""
    try:
        with trio.fail_after(REQUEST_TIMEOUT_S):
            response = await client.post_json(proxy_url, path, body)
    except (UpstreamError, trio.TooSlowError) as exc:
        log.debug("demo request failed: %s", exc)
        return
    if response.status == 200 and conversations is not None and not body.get("stream"):
        answer = response.json()["choices"][0]["message"]["content"]
        conversations.answered(body["messages"], answer)


def burst_text(seed: int, words: int = BURST_WORDS) -> str:
    """~58 KB of made-up words, ~12k DeepSeek tokens: ~30 ms to tokenize on these machines."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(BURST_VOCABULARY)}{rng.randrange(1000)}" for _ in range(words))


class DemoTraffic:
    """Steady traffic with Poisson arrivals, and now and then a burst that saturates the
    tokenizer: `burst_size` large prompts at once, each unique from its first word on, so
    that no cache helps. With one tokenizer thread and a queue of 8, a burst of 16 fills the
    thread and the queue, takes the capacity-one fallback (a stall of the loop) and leaves
    the rest to the saturation policy: they wait, or they bail out."""

    def __init__(
        self,
        rate: float,
        burst_interval: float,
        models: Sequence[str],
        *,
        seed: int = 0,
        burst_size: int = BURST_SIZE,
        first_burst_after: float = FIRST_BURST_AFTER_S,
    ) -> None:
        self.rate = rate
        self.burst_interval = burst_interval
        self.models = tuple(models)  # what the requests name; bursts go to the first
        self.burst_size = burst_size
        self.first_burst_after = first_burst_after
        self.bursts_sent = 0
        self._rng = random.Random(seed)
        self._asks, self._asked = trio.open_memory_channel[None](1)

    def request_burst(self) -> bool:
        """Ask for a burst now; False when one is already asked for and not yet sent."""
        try:
            self._asks.send_nowait(None)
        except trio.WouldBlock:
            return False
        return True

    async def run(self, proxy_url: str) -> None:
        """Send traffic to `proxy_url` forever."""
        client = Fetcher(
            connect_timeout=REQUEST_TIMEOUT_S, max_idle_per_backend=MAX_CONCURRENT_REQUESTS
        )
        async with contextlib.aclosing(client), trio.open_nursery() as nursery:
            nursery.start_soon(self._steady, client, proxy_url)
            nursery.start_soon(self._bursts, client, proxy_url)

    async def _steady(self, client: Fetcher, proxy_url: str) -> None:
        rng = self._rng
        conversations = Conversations(rng)
        limiter = trio.CapacityLimiter(MAX_CONCURRENT_REQUESTS)
        async with trio.open_nursery() as nursery:
            for body in requests(rng, conversations, self.models):
                await trio.sleep(rng.expovariate(self.rate))
                if limiter.available_tokens == 0:
                    continue

                async def one(body: dict[str, Any] = body) -> None:
                    async with limiter:
                        await _send(client, proxy_url, body, conversations)

                nursery.start_soon(one)

    async def _bursts(self, client: Fetcher, proxy_url: str) -> None:
        # Made once, in a thread: building ~58 KB of words holds the loop for milliseconds.
        text = await trio.to_thread.run_sync(burst_text, self._rng.randrange(10**9))
        wait = self.first_burst_after if self.burst_interval else math.inf
        while True:
            with trio.move_on_after(wait):
                await self._asked.receive()
            self.bursts_sent += 1
            log.info("demo: burst %d, %d large unique prompts", self.bursts_sent, self.burst_size)
            async with trio.open_nursery() as nursery:
                for index in range(self.burst_size):
                    body = {
                        "model": self.models[0],
                        "prompt": f"Burst {self.bursts_sent}.{index}: summarise this log. {text}",
                        "max_tokens": 8,
                    }
                    nursery.start_soon(_send, client, proxy_url, body, None, "/v1/completions")
            wait = self.burst_interval or math.inf
