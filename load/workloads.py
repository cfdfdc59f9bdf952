"""Workloads: what the load generator sends, made of realistic text. Pure and seeded.

The text is the seeds' own prose (`corpus.txt`: the posts this project grew from), cut into
sentences; at about 4 characters per token on the DeepSeek tokenizer, a token count becomes a
character count. Each workload is what a class of real traffic looks like to a proxy's
tokenizer caches and a backend's prefix cache:

- rag: a few long system prompts (2-4k tokens, retrieved documents) + a unique question;
- hot: one system prompt dominating (90% of requests), a few rare ones, and 30% of the
  questions from a short list of frequent ones (seed 000: user queries hit 10-30%);
- chat: conversations growing turn by turn to 50 turns, then a new conversation;
- unique: nothing repeats (a random nonce leads every prompt);
- burst: now and then a run of 20 unique large prompts at once (seed 000's pathological
  case), between them small cheap requests;
- long: conversations of thousands of short messages (template cost grows with messages);
- mixed: rag, hot, chat and unique interleaved.

`Workload.next()` returns the requests of one arrival: one request, or a whole burst.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 4.0
CORPUS_PATH = Path(__file__).with_name("corpus.txt")
FREQUENT_QUESTIONS = 20
WORKLOADS = ("rag", "hot", "chat", "unique", "burst", "long", "mixed")


@dataclass(frozen=True)
class Request:
    path: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict[str, Any]
    tag: str  # what kind of request, for per-kind reports ("cheap", "large", ...)


class Corpus:
    """Sentences of real prose, to cut texts of a given length from."""

    def __init__(self, text: str) -> None:
        sentences = [s.strip() for s in re.split(r"(?<=[.!?:])\s+", text)]
        self.sentences = [s for s in sentences if len(s) > 20]
        if not self.sentences:
            raise ValueError("the corpus holds no sentences")

    @classmethod
    def default(cls) -> Corpus:
        return cls(CORPUS_PATH.read_text(encoding="utf-8"))

    def text(self, rng: random.Random, tokens: int) -> str:
        """About `tokens` tokens of consecutive sentences from a random place."""
        chars = int(tokens * CHARS_PER_TOKEN)
        index = rng.randrange(len(self.sentences))
        parts: list[str] = []
        size = 0
        while size < chars:
            sentence = self.sentences[index % len(self.sentences)]
            parts.append(sentence)
            size += len(sentence) + 1
            index += 1
        return " ".join(parts)[:chars]

    def sentence(self, rng: random.Random) -> str:
        return rng.choice(self.sentences)


def nonce(rng: random.Random) -> str:
    return f"[{rng.getrandbits(48):012x}]"


def chat(messages: list[dict[str, str]], max_tokens: int) -> Request:
    body = {"model": "sim", "messages": messages, "max_tokens": max_tokens}
    return Request("/v1/chat/completions", body, "chat")


def completion(prompt: str, max_tokens: int, tag: str) -> Request:
    body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens}
    return Request("/v1/completions", body, tag)


@dataclass
class Workload:
    """An endless seeded source of requests; `next()` gives those of one arrival."""

    name: str
    corpus: Corpus
    rng: random.Random
    max_tokens: int = 16
    # Shapes, overridable by scenarios.
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (2000, 4000)
    chat_turns: int = 50
    conversations: int = 16
    long_messages: tuple[int, int] = (1500, 4000)
    burst_size: int = 20
    burst_tokens: int = 4000
    burst_every: int = 50
    unique_tokens: tuple[int, int] = (200, 1500)
    _systems: list[str] = field(default_factory=list)
    _conversations: list[list[dict[str, str]]] = field(default_factory=list)
    _arrivals: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; one of {', '.join(WORKLOADS)}")
        self._systems = [
            f"You are assistant #{i}. Answer from these documents.\n"
            + self.corpus.text(self.rng, self.rng.randint(*self.system_tokens))
            for i in range(self.system_prompts)
        ]
        self._conversations = [[] for _ in range(self.conversations)]

    def next(self) -> list[Request]:
        self._arrivals += 1
        make: Callable[[], list[Request]] = getattr(self, f"_{self.name}")
        return make()

    def _question(self) -> str:
        return f"{nonce(self.rng)} {self.corpus.sentence(self.rng)} What does this mean for me?"

    def _rag(self) -> list[Request]:
        system = self.rng.choice(self._systems)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": self._question()},
        ]
        return [chat(messages, self.max_tokens)]

    def _hot(self) -> list[Request]:
        system = self._systems[0] if self.rng.random() < 0.9 else self.rng.choice(self._systems)
        if self.rng.random() < 0.3:
            question = (
                f"Frequent question {self.rng.randrange(FREQUENT_QUESTIONS)}: where do I start?"
            )
        else:
            question = self._question()
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
        return [chat(messages, self.max_tokens)]

    def _chat(self) -> list[Request]:
        index = self.rng.randrange(len(self._conversations))
        conversation = self._conversations[index]
        if len(conversation) >= 2 * self.chat_turns:  # system + turns users + turns-1 replies
            conversation = self._conversations[index] = []
        if not conversation:
            conversation.append({"role": "system", "content": self._systems[0]})
        else:
            reply = self.corpus.text(self.rng, self.rng.randint(30, 120))
            conversation.append({"role": "assistant", "content": reply})
        conversation.append({"role": "user", "content": self._question()})
        return [chat(list(conversation), self.max_tokens)]

    def _unique(self) -> list[Request]:
        prompt = (
            nonce(self.rng)
            + " "
            + self.corpus.text(self.rng, self.rng.randint(*self.unique_tokens))
        )
        return [completion(prompt, self.max_tokens, "unique")]

    def _burst(self) -> list[Request]:
        if self._arrivals % self.burst_every == 1:
            return [
                completion(
                    nonce(self.rng) + " " + self.corpus.text(self.rng, self.burst_tokens),
                    1,
                    "large",
                )
                for _ in range(self.burst_size)
            ]
        hit = chat([{"role": "user", "content": "Say one word."}], 1)
        return [Request(hit.path, hit.body, "cheap")]

    def _long(self) -> list[Request]:
        count = self.rng.randint(*self.long_messages)
        messages = [{"role": "system", "content": "You are a patient assistant."}]
        for i in range(count):
            role = "user" if i % 2 == 0 else "assistant"
            # Short messages (<= 80 characters): the cost is in their number.
            messages.append({"role": role, "content": self.corpus.sentence(self.rng)[:80]})
        if messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": self._question()})
        request = chat(messages, self.max_tokens)
        return [Request(request.path, request.body, "long")]

    def _mixed(self) -> list[Request]:
        kind = self.rng.choices(("rag", "hot", "chat", "unique"), weights=(3, 3, 3, 1))[0]
        make: Callable[[], list[Request]] = getattr(self, f"_{kind}")
        requests = make()
        return [Request(r.path, r.body, kind) for r in requests]


def workload(name: str, seed: int = 0, **shape: Any) -> Workload:
    return Workload(name, Corpus.default(), random.Random(seed), **shape)
