"""Prompt text to token ids, without holding the event loop: L0, then the tokenizer dispatcher.

- L0 (exact text, LRU) is looked up on the loop: a hit costs a dictionary lookup.
- A miss goes to the dispatcher (dispatcher.py): a worker thread calling `encode_batch_fast`,
  which releases the GIL, then the capacity-one fallback on the loop, then the saturation
  policy (None: bail out, the request goes on without tokens). The job consults L1 (token ids
  of prefixes that end at added-token cuts, l1_cache.py) before encoding.
- Texts of a few dozen tokens are encoded on the loop at once (path `inline`): the trip to a
  thread costs more.
- `inline` mode, the naive baseline kept for comparisons: `Tokenizer.encode` on the loop, no
  caches.

Every outcome is counted, by model: per path in `sluice_tokenize_seconds`, cache hits and
misses, and the tokens each cache served (by requests and by tokens, as the dashboard shows
them).

A fleet has one `Tokenization` per distinct tokenizer (models that share a tokenizer share
it: same text, same ids) and one `TokenCaches` for all of them: L0 and the L1 store are
bounded once, whatever the number of models, each tokenizer in a namespace of its own.
"""

from __future__ import annotations

import functools
import time
from array import array
from typing import NotRequired, TypedDict

from app.models import NO_MODEL
from app.preprocess.dispatcher import Dispatcher, Phase
from app.preprocess.encoding import (
    TokenizerFacts,
    gil_releasing_counter,
    gil_releasing_encoder,
    naive_encoder,
)
from app.preprocess.l0_cache import L0Cache
from app.preprocess.l1_cache import L1Cache, L1Outcome, L1Store
from app.preprocess.metrics import PreprocessMetrics
from app.preprocess.settings import PreprocessSettings
from app.preprocess.tokenizer_loading import TokenizerLike

# Settings bound L0 by entries and text size; this bounds its total memory (10,000 entries
# of 64 KiB texts would otherwise reach ~1 GiB).
L0_MAX_MEMORY_BYTES = 256 * 1024 * 1024
# Texts this short are encoded on the loop at once (~64 tokens, tens of µs): cheaper than the
# trip to a thread, and a short chat never queues behind long prompts for one.
ON_LOOP_MAX_CHARS = 256
# The largest text the capacity-one fallback encodes on the loop: ~2k tokens, ~2 ms.
FALLBACK_MAX_CHARS = 8192
PATHS = {"offloaded": "thread", "fallback": "fallback", "inline": "inline"}


class TokenCounts(TypedDict):
    """Prompt tokens since start, and those served from each cache."""

    prompt: int
    from_l0: int
    from_l1: int


class DispatcherSnapshot(TypedDict):
    """A pool of workers (tokenizer threads, render processes) right now."""

    total: int
    busy: int
    queued: int
    queue_limit: int
    saturated_waiting: int


class L0Snapshot(TypedDict):
    entries: int
    memory_bytes: int
    max_entries: int
    max_bytes: int
    max_text_bytes: int
    hits: int
    misses: int


class L1Snapshot(TypedDict):
    enabled: bool
    unavailable_reason: str | None
    # With an L1 cache at all:
    entries: NotRequired[int]
    memory_bytes: NotRequired[int]
    max_bytes: NotRequired[int]
    hits: NotRequired[int]
    misses: NotRequired[int]
    mismatches: NotRequired[int]  # results that differed from a full encode, discarded


class TokenizerSnapshot(TypedDict):
    threads: DispatcherSnapshot
    fallback_busy: bool
    tokens: TokenCounts
    l0: L0Snapshot
    l1: L1Snapshot


class TokenCaches:
    """L0 and the L1 store shared by every tokenizer, and the prompt tokens they served."""

    def __init__(self, settings: PreprocessSettings) -> None:
        self.l0 = L0Cache(settings.l0_max_entries, L0_MAX_MEMORY_BYTES, settings.l0_max_text_bytes)
        self.l1 = L1Store(settings.l1_max_memory)
        self.l1_caches: list[L1Cache] = []  # one per tokenizer whose L1 can work
        self.namespaces = 0
        # Prompt tokens counted, and how many of them came from each cache, for the dashboard.
        self.tokens: TokenCounts = {"prompt": 0, "from_l0": 0, "from_l1": 0}

    def new_namespace(self) -> int:
        self.namespaces += 1
        return self.namespaces - 1


class Tokenization:
    def __init__(
        self,
        settings: PreprocessSettings,
        metrics: PreprocessMetrics,
        tokenizer: TokenizerLike,
        facts: TokenizerFacts,
        dispatcher: Dispatcher,
        phase: Phase,
        caches: TokenCaches | None = None,
    ) -> None:
        self._inline = settings.tokenize_mode == "inline"
        self._metrics = metrics
        self._facts = facts
        self.dispatcher = dispatcher
        self._phase = phase
        self._encode = gil_releasing_encoder(tokenizer)
        self._count_each = gil_releasing_counter(tokenizer)
        self._naive_encode = naive_encoder(tokenizer)
        self.caches = caches or TokenCaches(settings)
        self._namespace = self.caches.new_namespace()
        self._l0 = self.caches.l0
        self._tokens = self.caches.tokens
        finder = facts.finder
        self._l1 = (
            L1Cache(finder, self._encode, self.caches.l1, namespace=self._namespace)
            if finder
            else None
        )
        if self._l1 is not None:
            self.caches.l1_caches.append(self._l1)

    def encode_plain(self, text: str) -> list[int]:
        """`text`'s ids as prompts are encoded (no post-processor tokens), on the calling
        thread: for short start-up texts such as the backends' tokenizer probe."""
        return list(self._naive_encode(text))

    async def tokenize(
        self, text: str, model: str = NO_MODEL
    ) -> tuple[array[int] | None, str, float]:
        """The ids, the path that produced them, and the seconds it took; no ids when the
        tokenizer was saturated and the policy is to bail out. `model` labels the metrics."""
        start = time.perf_counter()
        ids: array[int] | None
        metrics = self._metrics
        if self._inline:
            with self._phase("tokenize-inline"):
                ids = self._naive_encode(text)
            path = "inline"
        else:
            ids = self._l0.get(text, self._namespace)
            if ids is not None:
                metrics.l0_hits.labels(model=model).inc()
                metrics.l0_hit_tokens.labels(model=model).inc(len(ids))
                self._tokens["from_l0"] += len(ids)
                path = "l0"
            else:
                metrics.l0_misses.labels(model=model).inc()
                if len(text) <= ON_LOOP_MAX_CHARS:
                    outcome, where = self._job(text), "inline"
                else:
                    job = functools.partial(self._job, text)
                    inline_ok = len(text) <= FALLBACK_MAX_CHARS
                    dispatched = await self.dispatcher.run(job, inline_ok=inline_ok)
                    if dispatched is None:
                        return None, "bailed_out", time.perf_counter() - start
                    outcome, where = dispatched
                self._count_l1(outcome, model)
                ids = outcome.ids
                path = "l1" if outcome.result == "hit" else PATHS[where]
                self._l0.put(text, ids, self._namespace)
                metrics.l0_entries.set(len(self._l0))
                metrics.l0_memory_bytes.set(self._l0.memory_bytes)
        seconds = time.perf_counter() - start
        metrics.tokenize_seconds.labels(path=path, model=model).observe(seconds)
        return ids, path, seconds

    async def count(self, texts: list[str]) -> list[int] | None:
        """How many tokens each text holds, counted in parallel (no caches: chunks of a
        prompt being proven too long), or None on bail-out."""
        job = functools.partial(self._count_each, texts)
        small = sum(map(len, texts)) <= FALLBACK_MAX_CHARS
        dispatched = await self.dispatcher.run(job, inline_ok=small)
        return None if dispatched is None else dispatched[0]

    def counted(self, prompt_tokens: int) -> None:
        self._tokens["prompt"] += prompt_tokens

    def _job(self, text: str) -> L1Outcome:
        """Runs in a worker thread or, as the fallback, on the loop."""
        if self._l1 is None:
            return L1Outcome(self._encode(text), "off")
        return self._l1.tokenize(text)

    def _count_l1(self, outcome: L1Outcome, model: str) -> None:
        metrics = self._metrics
        counters = {
            "hit": metrics.l1_hits,
            "miss": metrics.l1_misses,
            "mismatch": metrics.l1_mismatches,
        }
        counter = counters.get(outcome.result)
        if counter is not None:
            counter.labels(model=model).inc()
        metrics.l1_hit_tokens.labels(model=model).inc(outcome.cached_tokens)
        self._tokens["from_l1"] += outcome.cached_tokens
        metrics.l1_memory_bytes.set(self.caches.l1.memory_bytes)

    def l1_state(self) -> tuple[bool, str | None]:
        """Whether this tokenizer's L1 works, and why not."""
        if self._l1 is None:
            return False, self._facts.l1_unavailable
        return self._l1.disabled_reason is None, self._l1.disabled_reason

    def snapshot(self) -> TokenizerSnapshot:
        """The shared caches, and this tokenizer's L1 state."""
        caches, l0 = self.caches, self._l0
        enabled, reason = self.l1_state()
        l1: L1Snapshot = {"enabled": enabled, "unavailable_reason": reason}
        if caches.l1_caches:
            l1["entries"] = len(caches.l1)
            l1["memory_bytes"] = caches.l1.memory_bytes
            l1["max_bytes"] = caches.l1.max_bytes
            l1["hits"] = sum(c.hits for c in caches.l1_caches)
            l1["misses"] = sum(c.misses for c in caches.l1_caches)
            l1["mismatches"] = sum(c.mismatches for c in caches.l1_caches)
        return {
            "threads": dispatcher_snapshot(self.dispatcher),
            "fallback_busy": self.dispatcher.fallback_busy,
            "tokens": self._tokens.copy(),
            "l0": {
                "entries": len(l0),
                "memory_bytes": l0.memory_bytes,
                "max_entries": l0.max_entries,
                "max_bytes": l0.max_bytes,
                "max_text_bytes": l0.max_text_bytes,
                "hits": l0.hits,
                "misses": l0.misses,
            },
            "l1": l1,
        }


def dispatcher_snapshot(dispatcher: Dispatcher) -> DispatcherSnapshot:
    return {
        "total": dispatcher.workers,
        "busy": dispatcher.workers_busy,
        "queued": dispatcher.queued,
        "queue_limit": dispatcher.queue_limit,
        "saturated_waiting": dispatcher.saturated_waiting,
    }
