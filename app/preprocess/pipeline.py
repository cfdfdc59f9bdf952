"""The facade the proxy calls: request body in, rendered prompt and token ids out.

    preprocessor = Preprocessor(settings, metrics, phase=stall_monitor.phase)
    prepared = await preprocessor.prepare_chat(body)   # or prepare_completion(body)

Chat templates render on the event loop when their measured cost model says the render stays
under RENDER_ON_LOOP_BUDGET, in a thread otherwise (Jinja2 holds the GIL, but a thread yields
it every switch interval instead of holding the loop for the whole render). Tokenization goes
L0 (exact text, on the loop) -> the dispatcher (thread, capacity-one fallback, then the
saturation policy), whose job consults L1 (prefix at added-token cuts) before encoding.
`tokenize_mode="inline"` is the naive baseline kept for comparisons: no caches, no threads,
`Tokenizer.encode` and every render on the loop.
"""

from __future__ import annotations

import functools
import time
from array import array
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import trio

from app.config import Saturation, Settings
from app.observe.metrics import Metrics
from app.preprocess import request_bodies
from app.preprocess.chat_template import calibrate_render_cost, load_chat_template
from app.preprocess.dispatcher import Dispatcher, Phase
from app.preprocess.encoding import facts_for, gil_releasing_encoder, naive_encoder
from app.preprocess.errors import PreprocessError
from app.preprocess.l0_cache import L0Cache
from app.preprocess.l1_cache import L1Cache, L1Outcome
from app.preprocess.tokenizer_loading import (
    LoadedTokenizer,
    TokenizerLike,
    load_tokenizer,
    wrap_tokenizer,
)

__all__ = ["Prepared", "PreprocessError", "Preprocessor"]

RENDER_ON_LOOP_BUDGET = 1e-3  # seconds a render may hold the event loop
# Settings bound L0 by entries and text size; this bounds its total memory (10,000 entries
# of 64 KiB texts would otherwise reach ~1 GiB).
L0_MAX_MEMORY_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Prepared:
    prompt: str | None  # rendered chat prompt or completion text; None for token-id prompts
    # None if bailed out; else an array("I") (a list for given ids): list() it for JSON.
    token_ids: Sequence[int] | None
    estimated: bool  # True when tokens were skipped (bail-out): token checks skipped
    tokenize_path: str  # l0 | l1 | thread | fallback | inline | bailed_out | given
    template_seconds: float
    tokenize_seconds: float


def _no_phase(name: str) -> AbstractContextManager[None]:
    return nullcontext()


class Preprocessor:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        tokenizer: TokenizerLike | None = None,
        phase: Phase | None = None,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._phase = phase or _no_phase
        loaded = load_tokenizer(settings.tokenizer) if tokenizer is None else _wrap(tokenizer)
        self._source = loaded.source
        self._tokenizer = loaded.tokenizer
        self._facts = facts_for(loaded)
        self._template = load_chat_template(
            settings.chat_template, loaded, self._facts.added_tokens
        )
        self._render_cost = calibrate_render_cost(self._template) if self._template else None
        self._render_limiter = trio.CapacityLimiter(1)  # renders hold the GIL: one at a time
        self._encode = gil_releasing_encoder(loaded.tokenizer)
        self._naive_encode = naive_encoder(loaded.tokenizer)
        self._l0 = L0Cache(settings.l0_max_entries, L0_MAX_MEMORY_BYTES, settings.l0_max_text_bytes)
        finder = self._facts.finder
        self._l1 = L1Cache(finder, self._encode, settings.l1_max_memory) if finder else None
        self._dispatcher: Dispatcher[L1Outcome] = Dispatcher(
            self._tokenize_job,
            threads=settings.tokenize_threads,
            queue_limit=settings.tokenize_queue,
            saturation=settings.saturation,
            metrics=metrics,
            phase=self._phase,
        )

    @property
    def saturation(self) -> Saturation:
        return self._dispatcher.saturation

    @saturation.setter
    def saturation(self, policy: Saturation) -> None:
        self._dispatcher.saturation = policy

    def encode_plain(self, text: str) -> list[int]:
        """`text`'s ids as prompts are encoded (no post-processor tokens), on the calling
        thread: for short start-up texts such as the backends' tokenizer probe."""
        return list(self._naive_encode(text))

    def special_tokens(self) -> list[str]:
        """The tokenizer's special added tokens, lowest id first."""
        decoder = self._tokenizer.get_added_tokens_decoder()
        return [token.content for _, token in sorted(decoder.items()) if token.special]

    async def prepare_chat(
        self, body: dict[str, Any], *, backend_max_model_len: int | None = None
    ) -> Prepared:
        if self._template is None or self._render_cost is None:
            raise PreprocessError(
                f"no chat template is configured for tokenizer {self._source}; the server "
                f"must be started with --chat-template (or use /v1/completions)",
                None,
                "no_chat_template",
            )
        messages, chars = request_bodies.template_messages(body["messages"])
        render = functools.partial(
            self._template.render,
            messages,
            add_generation_prompt=request_bodies.add_generation_prompt(body),
            tools=body.get("tools"),
            documents=body.get("documents"),
            extra=request_bodies.template_extras(body),
        )
        start = time.perf_counter()
        estimate = self._render_cost.estimate(len(messages), chars)
        if self._settings.tokenize_mode == "inline" or estimate <= RENDER_ON_LOOP_BUDGET:
            with self._phase("template"):
                prompt = render()
        else:
            prompt = await trio.to_thread.run_sync(render, limiter=self._render_limiter)
        template_seconds = time.perf_counter() - start
        self._metrics.template_seconds.observe(template_seconds)

        ids, path, tokenize_seconds = await self._tokenize(prompt)
        return self._checked(
            Prepared(prompt, ids, ids is None, path, template_seconds, tokenize_seconds),
            body,
            backend_max_model_len,
        )

    async def prepare_completion(
        self, body: dict[str, Any], *, backend_max_model_len: int | None = None
    ) -> Prepared:
        prompt = request_bodies.completion_prompt(body, self._facts.vocab_size)
        if isinstance(prompt, list):
            return self._checked(
                Prepared(None, prompt, False, "given", 0.0, 0.0), body, backend_max_model_len
            )
        ids, path, tokenize_seconds = await self._tokenize(prompt)
        bos, eos = self._facts.bos_affix, self._facts.eos_affix
        if ids is not None and (bos or eos):
            ids = array("I", bos) + ids + array("I", eos)
        return self._checked(
            Prepared(prompt, ids, ids is None, path, 0.0, tokenize_seconds),
            body,
            backend_max_model_len,
        )

    async def _tokenize(self, text: str) -> tuple[array[int] | None, str, float]:
        start = time.perf_counter()
        ids: array[int] | None
        if self._settings.tokenize_mode == "inline":
            with self._phase("tokenize-inline"):
                ids = self._naive_encode(text)
            path = "inline"
        else:
            ids = self._l0.get(text)
            if ids is not None:
                self._metrics.l0_hits.inc()
                path = "l0"
            else:
                self._metrics.l0_misses.inc()
                dispatched = await self._dispatcher.run(text)
                if dispatched is None:
                    return None, "bailed_out", time.perf_counter() - start
                outcome, where = dispatched
                self._count_l1(outcome)
                ids = outcome.ids
                path = "l1" if outcome.result == "hit" else where
                self._l0.put(text, ids)
                self._metrics.l0_entries.set(len(self._l0))
                self._metrics.l0_memory_bytes.set(self._l0.memory_bytes)
        seconds = time.perf_counter() - start
        self._metrics.tokenize_seconds.labels(path=path).observe(seconds)
        return ids, path, seconds

    def _tokenize_job(self, text: str) -> L1Outcome:
        """Runs in a worker thread or, as the fallback, on the loop."""
        if self._l1 is None:
            return L1Outcome(self._encode(text), "off")
        return self._l1.tokenize(text)

    def _count_l1(self, outcome: L1Outcome) -> None:
        counters = {
            "hit": self._metrics.l1_hits,
            "miss": self._metrics.l1_misses,
            "mismatch": self._metrics.l1_mismatches,
        }
        counter = counters.get(outcome.result)
        if counter is not None:
            counter.inc()
        if self._l1 is not None:
            self._metrics.l1_memory_bytes.set(self._l1.memory_bytes)

    def _checked(
        self, prepared: Prepared, body: dict[str, Any], backend_max_model_len: int | None
    ) -> Prepared:
        """Refuse prompts that cannot fit the context window: --max-model-len, else the
        backends' own `max_model_len` (from /v1/models), when either is known."""
        limit = self._settings.max_model_len or backend_max_model_len
        if limit is None or prepared.token_ids is None:
            return prepared
        prompt_tokens = len(prepared.token_ids)
        completion = request_bodies.requested_completion_tokens(body)
        if prompt_tokens + completion > limit:
            raise PreprocessError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + completion} tokens ({prompt_tokens} in the prompt, "
                f"{completion} for the completion). Please reduce the length of the prompt "
                f"or of the completion.",
                "messages" if "messages" in body else "prompt",
                "context_length_exceeded",
            )
        return prepared

    def snapshot(self) -> dict[str, Any]:
        """Caches, queue and policy, for the dashboard."""
        d, l0 = self._dispatcher, self._l0
        cost = self._render_cost
        return {
            "mode": self._settings.tokenize_mode,
            "saturation": d.saturation,
            "tokenizer": self._source,
            "chat_template": self._template.origin if self._template else None,
            "render_on_loop": None
            if cost is None
            else {
                "budget_seconds": RENDER_ON_LOOP_BUDGET,
                "base_seconds": cost.base,
                "per_message_seconds": cost.per_message,
                "per_char_seconds": cost.per_char,
            },
            "threads": {
                "total": self._settings.tokenize_threads,
                "busy": d.threads_busy,
                "queued": d.queued,
                "queue_limit": d.queue_limit,
                "saturated_waiting": d.saturated_waiting,
            },
            "fallback_busy": d.fallback_busy,
            "l0": {
                "entries": len(l0),
                "memory_bytes": l0.memory_bytes,
                "max_entries": l0.max_entries,
                "max_bytes": l0.max_bytes,
                "max_text_bytes": l0.max_text_bytes,
                "hits": l0.hits,
                "misses": l0.misses,
            },
            "l1": self._l1_snapshot(),
        }

    def _l1_snapshot(self) -> dict[str, Any]:
        l1 = self._l1
        if l1 is None:
            return {"enabled": False, "unavailable_reason": self._facts.l1_unavailable}
        return {
            "enabled": l1.disabled_reason is None,
            "unavailable_reason": l1.disabled_reason,
            "entries": len(l1),
            "memory_bytes": l1.memory_bytes,
            "max_bytes": l1.max_bytes,
            "hits": l1.hits,
            "misses": l1.misses,
            "mismatches": l1.mismatches,
        }


# One LoadedTokenizer per injected object, so its startup facts are computed once. The value
# holds the tokenizer, so its id cannot be reused while it is cached.
_injected: dict[int, LoadedTokenizer] = {}


def _wrap(tokenizer: TokenizerLike) -> LoadedTokenizer:
    loaded = _injected.get(id(tokenizer))
    if loaded is None:
        loaded = _injected[id(tokenizer)] = wrap_tokenizer(tokenizer)
    return loaded
