"""The facade the proxy calls: request body in, rendered prompt and token ids out.

    preprocessor = Preprocessor(settings, metrics, phase=stall_monitor.phase)
    async with preprocessor.running():          # the render worker processes
        prepared = await preprocessor.prepare("chat", body)   # or "completion"

Where the work runs, so that none of it holds the event loop for long:
- parse, checks and render (rendering.py): on the loop when the body is small and the render
  is estimated under RENDER_ON_LOOP_BUDGET; otherwise in a render worker process (workers.py),
  behind the dispatcher's queue, capacity-one fallback and saturation policy.
- a prompt that cannot fit the context window is refused from its size, or from a counted
  prefix, before it is tokenized whole (length_gate.py).
- tokens: L0, then the tokenizer dispatcher and L1 (tokenization.py).
`tokenize_mode="inline"` is the naive baseline kept for comparisons: everything on the loop,
`Tokenizer.encode` included, no caches.
"""

from __future__ import annotations

import functools
import time
from array import array
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge

from app.config import Saturation, Settings
from app.errors import ClientError
from app.observe.metrics import Metrics
from app.preprocess import length_gate, request_bodies
from app.preprocess.chat_template import calibrate_render_cost, load_chat_template
from app.preprocess.dispatcher import Dispatcher, Offload, Phase
from app.preprocess.encoding import facts_for
from app.preprocess.rendering import (
    Kind,
    Rendered,
    RenderSpec,
    render_body,
    render_payload,
    warm_up,
)
from app.preprocess.tokenization import Tokenization, dispatcher_snapshot
from app.preprocess.tokenizer_loading import (
    LoadedTokenizer,
    TokenizerLike,
    load_tokenizer,
    wrap_tokenizer,
)
from app.preprocess.workers import ProcessPool, in_thread

__all__ = ["Prepared", "Preprocessor"]

RENDER_ON_LOOP_BUDGET = 1e-3  # seconds a render may hold the event loop
# Bodies parsed on the loop: json.loads takes ~0.25 ms for 64 KiB here (1.7 ms for 438 KB,
# 22 ms for 12 MB), so anything larger is parsed where the render happens, off the loop.
PARSE_ON_LOOP_BYTES = 64 * 1024


@dataclass(frozen=True)
class Prepared:
    # The request's fields but its prompt; empty when it bailed out before being parsed.
    fields: dict[str, Any]
    # The rendered chat prompt or completion text (only its head for a prompt that bailed out
    # while proven too long could not be decided); None for token-id prompts and bail-outs
    # before rendering.
    prompt: str | None
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
        self._spec = RenderSpec(self._template, self._source, self._facts.vocab_size)
        self._render_cost = calibrate_render_cost(self._template) if self._template else None
        self._processes = ProcessPool(settings.render_workers)
        self._renders = self._dispatcher(
            self._processes,
            settings.render_workers,
            "template-fallback",
            metrics.render_queue_depth,
        )
        threads = self._dispatcher(
            in_thread, settings.tokenize_threads, "tokenize-fallback", metrics.tokenize_queue_depth
        )
        self._tokens = Tokenization(
            settings, metrics, loaded.tokenizer, self._facts, threads, self._phase
        )

    def _dispatcher(
        self, offload: Offload, workers: int, fallback_phase: str, queue_depth: Gauge
    ) -> Dispatcher:
        return Dispatcher(
            offload,
            workers=workers,
            queue_limit=self._settings.tokenize_queue,
            saturation=self._settings.saturation,
            phase=self._phase,
            fallback_phase=fallback_phase,
            queue_depth=queue_depth,
            saturated=self._metrics.tokenize_saturated,
        )

    def running(self) -> AbstractAsyncContextManager[None]:
        """The render worker processes, started (and warmed up) for as long as it is open."""
        return self._processes.running(functools.partial(warm_up, self._spec))

    @property
    def saturation(self) -> Saturation:
        return self._renders.saturation

    @saturation.setter
    def saturation(self, policy: Saturation) -> None:
        self._renders.saturation = policy
        self._tokens.dispatcher.saturation = policy

    def encode_plain(self, text: str) -> list[int]:
        """`text`'s ids as prompts are encoded (no post-processor tokens), on the calling
        thread: for short start-up texts such as the backends' tokenizer probe."""
        return self._tokens.encode_plain(text)

    def special_tokens(self) -> list[str]:
        """The tokenizer's special added tokens, lowest id first."""
        decoder = self._tokenizer.get_added_tokens_decoder()
        return [token.content for _, token in sorted(decoder.items()) if token.special]

    async def prepare(
        self, kind: Kind, body: bytes, *, backend_max_model_len: int | None = None
    ) -> Prepared:
        """Parse, check, render and tokenize one request body; `ClientError` if it is bad.

        The context window is --max-model-len, else the backends' own `max_model_len`
        (from /v1/models), when either is known.
        """
        limit = self._settings.max_model_len or backend_max_model_len
        started = time.perf_counter()
        rendered = await self._render(kind, body, limit)
        template_seconds = time.perf_counter() - started
        if rendered is None:
            return _bailed_out({}, None, template_seconds)
        if kind == "chat":
            self._metrics.template_seconds.observe(template_seconds)
        if isinstance(rendered.prompt, list):
            prepared = Prepared(rendered.fields, None, rendered.prompt, False, "given", 0.0, 0.0)
            return self._checked(kind, prepared, limit)
        if limit is not None and self._settings.tokenize_mode != "inline":
            budget = limit - request_bodies.requested_completion_tokens(rendered.fields)
            fits = await self._refuse_if_too_long(kind, body, rendered, budget, limit)
            if fits is None:
                return _bailed_out(rendered.fields, str(rendered.prompt), template_seconds)
            rendered = fits
        prompt = str(rendered.prompt)
        ids, path, tokenize_seconds = await self._tokens.tokenize(prompt)
        bos, eos = self._facts.bos_affix, self._facts.eos_affix
        if kind == "completion" and ids is not None and (bos or eos):
            ids = array("I", bos) + ids + array("I", eos)
        prepared = Prepared(
            rendered.fields, prompt, ids, ids is None, path, template_seconds, tokenize_seconds
        )
        return self._checked(kind, prepared, limit)

    async def _render(self, kind: Kind, body: bytes, limit: int | None) -> Rendered | None:
        """The request parsed, checked and rendered, where that is cheapest for the loop;
        None when the render workers are saturated and the policy is to bail out."""
        head = None if limit is None else length_gate.head_chars(limit)
        phase = self._phase("template") if kind == "chat" else nullcontext()
        if self._settings.tokenize_mode == "inline":
            with phase:
                return render_body(kind, body, self._spec, head)
        if len(body) <= PARSE_ON_LOOP_BYTES:
            payload = request_bodies.parse_json_object(body)
            if self._renders_on_loop(kind, payload, len(body)):
                with phase:
                    return render_payload(kind, payload, self._spec, head)
        return await self._render_off_loop(kind, body, head)

    async def _render_off_loop(self, kind: Kind, body: bytes, head: int | None) -> Rendered | None:
        job = functools.partial(render_body, kind, body, self._spec, head)
        try:
            # Bodies parsed on the loop already, whose render was estimated over the loop's
            # budget, may fall back to the loop; larger ones never.
            dispatched = await self._renders.run(job, inline_ok=len(body) <= PARSE_ON_LOOP_BYTES)
        except RecursionError:
            # JSON within the parser's depth can still be too deep to pickle back.
            raise request_bodies.nested_too_deeply() from None
        return None if dispatched is None else dispatched[0]

    def _renders_on_loop(self, kind: Kind, payload: dict[str, Any], chars: int) -> bool:
        messages = payload.get("messages")
        if kind == "completion" or self._render_cost is None or not isinstance(messages, list):
            return True  # nothing to render, or refused at once
        return self._render_cost.estimate(len(messages), chars) <= RENDER_ON_LOOP_BUDGET

    async def _refuse_if_too_long(
        self, kind: Kind, body: bytes, rendered: Rendered, budget: int, limit: int
    ) -> Rendered | None:
        """Refuse a prompt proven longer than `budget` tokens, encoding no more of it than the
        proof needs. Returns the whole rendered request when it may fit, None on bail-out."""
        bound = self._facts.max_token_bytes
        if length_gate.too_many_bytes(rendered.prompt_bytes, budget, bound):
            assert bound is not None
            least = length_gate.least_tokens(rendered.prompt_bytes, bound)
            raise _too_long(kind, limit, budget, f"at least {least}")
        text = str(rendered.prompt)
        if length_gate.worth_proving(rendered.prompt_chars, budget):
            proof = length_gate.PrefixCount(text, budget, truncated=not rendered.complete)
            while not proof.exhausted and not proof.proven_too_long:
                end = proof.next_cut()
                counted = await self._tokens.count(text[proof.position : end])
                if counted is None:
                    return None
                proof.counted(end, counted)
            if proof.proven_too_long:
                raise _too_long(kind, limit, budget, f"more than {budget}")
        if rendered.complete:
            return rendered
        # Long yet possibly within the window (dense text): the whole prompt is needed now.
        return await self._render_off_loop(kind, body, None)

    def _checked(self, kind: Kind, prepared: Prepared, limit: int | None) -> Prepared:
        """Refuse a prompt whose exact token count does not fit the context window."""
        if prepared.token_ids is None:
            return prepared
        prompt_tokens = len(prepared.token_ids)
        self._tokens.counted(prompt_tokens)
        if limit is None:
            return prepared
        completion = request_bodies.requested_completion_tokens(prepared.fields)
        if prompt_tokens + completion > limit:
            raise ClientError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + completion} tokens ({prompt_tokens} in the prompt, "
                f"{completion} for the completion). Please reduce the length of the prompt "
                f"or of the completion.",
                "messages" if kind == "chat" else "prompt",
                "context_length_exceeded",
            )
        return prepared

    def tokenizer_peaks(self) -> dict[str, int]:
        """The tokenizer dispatcher's busiest moments since the last call (Dispatcher)."""
        return self._tokens.dispatcher.take_peaks()

    def snapshot(self) -> dict[str, Any]:
        """Caches, queues and policy, for the dashboard."""
        renders, cost = self._renders, self._render_cost
        return {
            "mode": self._settings.tokenize_mode,
            "saturation": renders.saturation,
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
            "render": dispatcher_snapshot(renders) | {"fallback_busy": renders.fallback_busy},
            **self._tokens.snapshot(),
        }


def _bailed_out(fields: dict[str, Any], prompt: str | None, template_seconds: float) -> Prepared:
    """Saturated and told to bail out: the request goes on without tokens."""
    return Prepared(fields, prompt, None, True, "bailed_out", template_seconds, 0.0)


def _too_long(kind: Kind, limit: int, budget: int, prompt_tokens: str) -> ClientError:
    completion = limit - budget
    where = "messages" if kind == "chat" else "prompt"
    return ClientError(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"more than {limit} tokens ({prompt_tokens} in the {where}, {completion} for the "
        f"completion). Please reduce the length of the {where} or of the completion.",
        where,
        "context_length_exceeded",
    )


# One LoadedTokenizer per injected object, so its startup facts are computed once. The value
# holds the tokenizer, so its id cannot be reused while it is cached.
_injected: dict[int, LoadedTokenizer] = {}


def _wrap(tokenizer: TokenizerLike) -> LoadedTokenizer:
    loaded = _injected.get(id(tokenizer))
    if loaded is None:
        loaded = _injected[id(tokenizer)] = wrap_tokenizer(tokenizer)
    return loaded
