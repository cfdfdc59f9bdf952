"""The routing benchmark's traffic, seeded so that every variant gets the same requests.

- rag: 8 system prompts of ~2,000 words (the simulated backend counts a word as a token)
  and a unique question each time: what a retrieval-augmented app sends.
- hot: one system prompt in 70% of the requests, the rest spread over 8 others: the hot one
  alone arrives faster than one backend can serve.
- chat: conversations of a ~300-word system prompt that grow turn by turn to 20 turns,
  each turn carrying the previous answers, then start over.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MODEL = "deepseek-ai/DeepSeek-V4-sim"
WORKLOADS = ("rag", "hot", "chat")
_VOCABULARY = (
    "retrieval", "context", "passage", "section", "clause", "figure", "table", "metric",
    "latency", "budget", "cluster", "region", "replica", "shard", "index", "vector",
    "embedding", "ranking", "query", "answer", "source", "citation", "policy", "contract",
    "invoice", "customer", "ticket", "incident", "outage", "deploy", "rollback", "release",
    "kernel", "memory", "tensor", "layer", "attention", "window", "token", "prefix", "cache",
    "block", "batch", "decode",
)  # fmt: skip


def document(number: int, words: int) -> str:
    """A long, reproducible system prompt whose very first words already differ by number."""
    rng = random.Random(f"document-{number}")
    body = " ".join(rng.choice(_VOCABULARY) for _ in range(words))
    return f"Document {number} of the knowledge base. Answer only from it. {body}"


def question(rng: random.Random) -> str:
    words = " ".join(rng.choice(_VOCABULARY) for _ in range(18))
    return f"Question {rng.randrange(10**9)}: how does {words} work?"


@dataclass
class Arrival:
    at: float  # seconds after the start
    conversation: int | None  # chat only
    messages: list[dict[str, str]] = field(default_factory=list)


def arrivals(rate: float, duration: float, rng: random.Random) -> Iterator[float]:
    """Poisson arrival times in [0, duration)."""
    at = rng.expovariate(rate)
    while at < duration:
        yield at
        at += rng.expovariate(rate)


def static_plan(workload: str, rate: float, duration: float, seed: int) -> list[Arrival]:
    """rag and hot: every request is known in advance."""
    rng = random.Random(f"{workload}-{seed}")
    rag_docs = [document(n, 2000) for n in range(8)]
    hot_doc = document(100, 2000)
    plan: list[Arrival] = []
    for at in arrivals(rate, duration, rng):
        if workload == "rag":
            system = rng.choice(rag_docs)
        else:
            system = hot_doc if rng.random() < 0.7 else rng.choice(rag_docs)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": question(rng)},
        ]
        plan.append(Arrival(at, None, messages))
    return plan


class Conversations:
    """chat: `count` conversations; each arrival extends one that is not waiting for an answer."""

    MAX_TURNS = 20

    def __init__(self, count: int, seed: int) -> None:
        self._rng = random.Random(f"chat-{seed}")
        self._generation = [0] * count
        self._histories = [self._fresh(n) for n in range(count)]
        self._busy: set[int] = set()

    def _fresh(self, number: int) -> list[dict[str, str]]:
        system = document(1000 + number * 100 + self._generation[number], 300)
        return [{"role": "system", "content": system}]

    def next(self) -> tuple[int, list[dict[str, str]]] | None:
        idle = [n for n in range(len(self._histories)) if n not in self._busy]
        if not idle:
            return None
        number = self._rng.choice(idle)
        history = self._histories[number]
        if len(history) > 2 * self.MAX_TURNS:
            self._generation[number] += 1
            history = self._histories[number] = self._fresh(number)
        history.append({"role": "user", "content": question(self._rng)})
        self._busy.add(number)
        return number, list(history)

    def answered(self, number: int, answer: str | None) -> None:
        self._busy.discard(number)
        history = self._histories[number]
        if answer is None:  # failed: forget the question, as a user retrying would resend it
            history.pop()
        else:
            history.append({"role": "assistant", "content": answer})


def body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
