"""The facade the proxy calls: request body in, served model, rendered prompt and token ids out.

    preprocessor = Preprocessor(settings, metrics, phase=stall_monitor.phase)
    async with preprocessor.running():          # the render worker processes
        prepared = await preprocessor.prepare("chat", body, models=directory, allowed=...)

A body walks one way: parse -> check -> resolve the model -> render (to_prompt.py, one
function wherever it runs) -> keep to the window (length_gate.py) -> tokenize
(tokenization.py), each stage handing the next a typed value, and `Prepared` at the end.
Each model is prepared its own way (model_preps.py): the body's `model`, resolved against
the `ModelDirectory` the proxy passes (aliases, the one model served, 404 for the rest),
picks the template, tokenizer, caches and context window. Without a directory the model is
only required, and the flags' tokenizer, template and `--max-model-len` serve every request.

Where the work runs, so that none of it holds the event loop for long:
- parse, checks and render: on the loop when the body is small and the render is estimated
  under the loop's budget; otherwise in a render worker process (workers.py), behind the
  dispatcher's queue, capacity-one fallback and saturation policy.
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
from typing import Any, TypedDict

from prometheus_client import Gauge

from app.config import Saturation, TokenizeMode
from app.errors import ClientError
from app.models import NO_MODEL, ModelDirectory
from app.preprocess import length_gate
from app.preprocess.dispatcher import Dispatcher, Offload, Phase
from app.preprocess.json_bodies import nested_too_deeply
from app.preprocess.metrics import PreprocessMetrics
from app.preprocess.model_preps import ModelDescription, ModelPrep, ModelPreps
from app.preprocess.rendering import (
    RENDER_ON_LOOP_BUDGET,
    RenderedRequest,
    RenderPlan,
    render,
    warm_up,
)
from app.preprocess.request_bodies import ROUTING_RENDERS, Kind
from app.preprocess.settings import PreprocessSettings
from app.preprocess.to_prompt import forget_whole, read_whole, render_job, render_request
from app.preprocess.tokenization import (
    DispatcherSnapshot,
    TokenizerSnapshot,
    dispatcher_snapshot,
)
from app.preprocess.tokenizer_loading import (
    LoadedTokenizer,
    TokenizerLike,
    load_tokenizer,
    wrap_tokenizer,
)
from app.preprocess.workers import ProcessPool, in_thread

__all__ = ["Prepared", "Preprocessor"]

# Bodies parsed on the loop: json.loads takes ~0.25 ms for 64 KiB here (1.7 ms for 438 KB,
# 22 ms for 12 MB), so anything larger is parsed where the render happens, off the loop.
PARSE_ON_LOOP_BYTES = 64 * 1024
# A long prompt's proof counts its chunks this many pieces at a time, in parallel on the
# tokenizer's threads: a 12 MB prompt proven too long in half the time on 2 cores.
COUNT_PIECES = 8


class RenderOnLoop(TypedDict):
    """What a render may cost on the event loop, and what the default's costs."""

    budget_seconds: float
    base_seconds: float
    per_message_seconds: float
    per_char_seconds: float


class RenderSnapshot(DispatcherSnapshot):
    fallback_busy: bool


class PreprocessSnapshot(ModelDescription, TokenizerSnapshot):
    """The `preprocess` block of the dashboard's snapshot (tokenizer and chat template:
    the default's)."""

    mode: TokenizeMode
    saturation: Saturation  # the policy in force
    tokenizers: int  # distinct, loaded
    models: dict[str, ModelDescription]  # configured models
    render_on_loop: RenderOnLoop | None
    render: RenderSnapshot  # the template render workers


@dataclass(slots=True)
class Prepared:
    # The served model (an alias resolved); None when it was not resolved (no directory, or
    # a bail-out before the body was parsed with one model served, which it then goes to).
    model: str | None
    # The request's fields but its prompt; empty when it bailed out before being parsed.
    fields: dict[str, Any]
    # The rendered chat prompt or completion text (only its head for a prompt that bailed out
    # while proven too long could not be decided); None for token-id prompts and bail-outs
    # before rendering.
    prompt: str | None
    tokenize_path: str  # l0 | l1 | thread | fallback | inline | given | bailed_out | none
    template_seconds: float
    # An array("I") (a list for given ids): list() it for JSON. None when the request goes on
    # without them (it bailed out, or has no prompt of Sluice's to tokenize).
    token_ids: Sequence[int] | None = None
    tokenize_seconds: float = 0.0
    # The body to forward when the model had to be rewritten (an alias, or no model named);
    # None: the client's own.
    forward_body: bytes | None = None

    @property
    def estimated(self) -> bool:
        """No token ids: the token checks were skipped, and counts are estimates."""
        return self.token_ids is None


def _no_phase(name: str) -> AbstractContextManager[None]:
    return nullcontext()


class Preprocessor:
    def __init__(
        self,
        settings: PreprocessSettings,
        metrics: PreprocessMetrics,
        *,
        tokenizer: TokenizerLike | None = None,
        phase: Phase | None = None,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._phase = phase or _no_phase
        loaded = load_tokenizer(settings.tokenizer) if tokenizer is None else _wrap(tokenizer)
        self._processes = ProcessPool()
        self._renders = self._dispatcher(
            self._processes,
            settings.render_workers,
            "template-fallback",
            metrics.render_queue_depth,
        )
        threads = self._dispatcher(
            in_thread, settings.tokenize_threads, "tokenize-fallback", metrics.tokenize_queue_depth
        )
        self.preps = ModelPreps(settings, metrics, loaded, threads, self._phase)
        self._threads = threads

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
        """The render worker processes, started (and warmed up) as they are needed, for as
        long as it is open."""
        return self._processes.running(functools.partial(warm_up, self.preps.specs()))

    @property
    def saturation(self) -> Saturation:
        return self._renders.saturation

    @saturation.setter
    def saturation(self, policy: Saturation) -> None:
        self._renders.saturation = policy
        self._threads.saturation = policy

    def encode_plain(self, text: str) -> list[int]:
        """`text`'s ids as prompts are encoded (no post-processor tokens), on the calling
        thread: for short start-up texts such as the backends' tokenizer probe."""
        return self.preps.default.tokens.encode_plain(text)

    def special_tokens(self) -> list[str]:
        """The default tokenizer's special added tokens, lowest id first."""
        decoder = self.preps.default.loaded.tokenizer.get_added_tokens_decoder()
        return [token.content for _, token in sorted(decoder.items()) if token.special]

    async def prepare(
        self,
        kind: Kind,
        body: bytes,
        *,
        models: ModelDirectory | None = None,
        allowed: frozenset[str] | None = None,
    ) -> Prepared:
        """Parse, check, resolve the model of, render and tokenize one request body;
        `ClientError` if it is bad (404 for a model that is not served, or not `allowed`).

        The context window is the model's in `models` (configured, --max-model-len, or its
        backends' own `max_model_len`); without a directory, --max-model-len.
        """
        plan = self.preps.plan(models, allowed)
        started = time.perf_counter()
        rendered = await self._render(kind, body, plan)
        template_seconds = time.perf_counter() - started
        if rendered is None:
            only = models.only if models is not None else None
            return _bailed_out(only, template_seconds)
        prep = self.preps.for_model(rendered.model, models)
        if rendered.messages:
            label = rendered.model or NO_MODEL
            self._metrics.template_seconds.labels(model=label).observe(template_seconds)
        if isinstance(rendered.prompt, list):
            return self._checked(kind, prep, rendered, rendered.prompt, "given", 0.0, 0.0)
        if not rendered.prompt:  # routed by its model alone (embeddings, uploads, ...)
            return _untokenized(rendered, template_seconds)
        # A conversation the engine renders itself is tokenized to route it, not judged.
        window = None if kind in ROUTING_RENDERS else rendered.window
        if window is not None and self._settings.tokenize_mode != "inline":
            try:
                fits = await self._refuse_if_too_long(kind, prep, rendered, window)
            finally:
                await forget_whole(rendered)
            if fits is None:
                return _bailed_out(rendered.model, template_seconds, rendered)
            rendered = fits
        prompt = str(rendered.prompt)
        ids, path, seconds = await prep.tokens.tokenize(prompt, rendered.model or NO_MODEL)
        bos, eos = prep.facts.bos_affix, prep.facts.eos_affix
        if kind == "completion" and ids is not None and (bos or eos):
            ids = array("I", bos) + ids + array("I", eos)
        return self._checked(kind, prep, rendered, ids, path, template_seconds, seconds)

    async def _render(self, kind: Kind, body: bytes, plan: RenderPlan) -> RenderedRequest | None:
        """The body's prompt, rendered where that is cheapest for the loop; None when the
        render workers are saturated and the policy is to bail out."""
        inline = self._settings.tokenize_mode == "inline"
        if not inline and len(body) > PARSE_ON_LOOP_BYTES:
            return await self._render_off_loop(kind, body, plan)
        with self._phase("template") if kind == "chat" else nullcontext():
            rendered = render_request(kind, body, plan, on_loop=not inline)
        if isinstance(rendered, RenderedRequest):
            return rendered
        # Parsed on the loop, its render estimated over the loop's budget: a worker renders
        # it, or the loop as the fallback (it is small: it was parsed here).
        dispatched = await self._renders.run(
            functools.partial(render, rendered), may_bail=_may_bail(plan)
        )
        return None if dispatched is None else dispatched[0]

    async def _render_off_loop(
        self, kind: Kind, body: bytes, plan: RenderPlan
    ) -> RenderedRequest | None:
        """A body too large to parse on the loop: every stage in a render worker."""
        try:
            async with render_job(kind, body, plan) as job:
                dispatched = await self._renders.run(job, inline_ok=False, may_bail=_may_bail(plan))
        except RecursionError:
            # JSON within the parser's depth can still be too deep to pickle back.
            raise nested_too_deeply() from None
        return None if dispatched is None else dispatched[0]

    async def _refuse_if_too_long(
        self, kind: Kind, prep: ModelPrep, rendered: RenderedRequest, window: int
    ) -> RenderedRequest | None:
        """Refuse a prompt proven too long for `window`, encoding no more of it than the proof
        needs. Returns the request with its whole prompt when it may fit, None on bail-out."""
        budget = window - rendered.completion_tokens
        bound = prep.facts.max_token_bytes
        if length_gate.too_many_bytes(rendered.prompt_bytes, budget, bound):
            assert bound is not None
            least = length_gate.least_tokens(rendered.prompt_bytes, bound)
            raise _too_long(kind, window, budget, f"at least {least}")
        text = str(rendered.prompt)
        if length_gate.worth_proving(rendered.prompt_chars, budget):
            proof = length_gate.PrefixCount(text, budget, truncated=not rendered.complete)
            while not proof.exhausted and not proof.proven_too_long:
                ends = proof.next_cuts(COUNT_PIECES)
                starts = [proof.position, *ends[:-1]]
                counts = await prep.tokens.count(
                    [text[start:end] for start, end in zip(starts, ends, strict=True)]
                )
                if counts is None:
                    return None
                for end, counted in zip(ends, counts, strict=True):
                    proof.counted(end, counted)
            if proof.proven_too_long:
                raise _too_long(kind, window, budget, f"more than {budget}")
        # Long yet possibly within the window (dense text): the whole prompt is needed now.
        return await read_whole(rendered)

    def _checked(
        self,
        kind: Kind,
        prep: ModelPrep,
        rendered: RenderedRequest,
        ids: Sequence[int] | None,
        path: str,
        template_seconds: float,
        tokenize_seconds: float,
    ) -> Prepared:
        """The prepared request, once its exact token count is known to fit its window."""
        prepared = Prepared(
            model=rendered.model,
            fields=rendered.fields,
            prompt=None if isinstance(rendered.prompt, list) else rendered.prompt,
            tokenize_path=path,
            template_seconds=template_seconds,
            token_ids=ids,
            tokenize_seconds=tokenize_seconds,
            forward_body=rendered.body,
        )
        if ids is None:
            return prepared
        prompt_tokens = len(ids)
        prep.tokens.counted(prompt_tokens)
        window, completion = rendered.window, rendered.completion_tokens
        if kind in ROUTING_RENDERS:  # the engine's to judge: it renders the prompt itself
            window = None
        if window is not None and prompt_tokens + completion > window:
            raise ClientError(
                f"This model's maximum context length is {window} tokens. However, you "
                f"requested {prompt_tokens + completion} tokens ({prompt_tokens} in the prompt, "
                f"{completion} for the completion). Please reduce the length of the prompt "
                f"or of the completion.",
                "messages" if kind == "chat" else "prompt",
                "context_length_exceeded",
            )
        return prepared

    def tokenizer_peaks(self) -> dict[str, int]:
        """The tokenizer dispatcher's busiest moments since the last call (Dispatcher)."""
        return self._threads.take_peaks()

    def snapshot(self) -> PreprocessSnapshot:
        """Caches, queues and policy, for the dashboard; tokenizer and template are the
        default's (`models` has each configured model's)."""
        renders, default = self._renders, self.preps.default
        cost = default.spec.cost
        return {
            "mode": self._settings.tokenize_mode,
            "saturation": renders.saturation,
            **default.describe(),
            "tokenizers": self.preps.tokenizers,
            "models": self.preps.describe(),
            "render_on_loop": None
            if cost is None
            else {
                "budget_seconds": RENDER_ON_LOOP_BUDGET,
                "base_seconds": cost.base,
                "per_message_seconds": cost.per_message,
                "per_char_seconds": cost.per_char,
            },
            "render": {**dispatcher_snapshot(renders), "fallback_busy": renders.fallback_busy},
            **default.tokens.snapshot(),
        }


def _bailed_out(
    model: str | None, template_seconds: float, rendered: RenderedRequest | None = None
) -> Prepared:
    """Saturated and told to bail out: the request goes on without tokens (and, bailing out
    before its render, unparsed: with one model served, it goes to that one)."""
    if rendered is None:
        return Prepared(model, {}, None, "bailed_out", template_seconds)
    prompt, body = str(rendered.prompt), rendered.body
    return Prepared(
        model, rendered.fields, prompt, "bailed_out", template_seconds, forward_body=body
    )


def _untokenized(rendered: RenderedRequest, template_seconds: float) -> Prepared:
    """A request with no prompt of Sluice's to tokenize: its usage is what the engine says."""
    model, fields, body = rendered.model, rendered.fields, rendered.body
    return Prepared(model, fields, None, "none", template_seconds, forward_body=body)


def _may_bail(plan: RenderPlan) -> bool:
    """Whether a request may go on without its render: only where its body needs no reading
    (no directory, or one model served and no alias to rewrite) and the key may use it."""
    directory = plan.models
    if directory is None:
        return True
    return not directory.needs_body() and (plan.allowed is None or directory.only in plan.allowed)


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
