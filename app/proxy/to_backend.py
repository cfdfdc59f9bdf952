"""A decided request's way to a backend: open its answer, retry once, and close the books.

`Forwarder.open` asks the decision for a backend (held at its pool's gate while every engine
is saturated), sends the request (its headers as headers.py says) and turns the backend's
answer into the client's `Reply` (relay.py); when the backend failed before answering, the
decision's first fallback is tried. A refusal or a failure (app/errors.py's `Refused`,
`UpstreamError`) is a reply of Sluice's own. Nothing here writes to the client: the exchange
sends the reply, then `close` counts how it went (the backend's breaker, its status) and
tells the decision the request ended, with the usage its answer reported. `Forwarder.direct`
is the way of a request that belongs to one backend and is no inference (a stored response's
GET, DELETE or cancel): no routing, no retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from app.errors import Refused, UpstreamError, UpstreamFault
from app.fleet.backends import ANY_MODEL, FAULT_STATUSES, Backend
from app.fleet.pool import BackendPool
from app.http.client import UpstreamPool
from app.http.fields import Headers
from app.http.relay_hub import RelayHub
from app.http.reply import Reply, error_reply
from app.observe.timing import Timing
from app.preprocess.endpoints import Endpoint
from app.proxy.prefill_usage import Chained, PrefillCachedTokens, PrefillFigure
from app.proxy.relay import Converter, Passage, chat_reply_from, reply_from
from app.proxy.response_ids import IdTagger
from app.routing.decider import Decider, RequestContext
from app.routing.decision import Decision
from app.routing.metrics import DoorMetrics
from app.routing.router import Router
from app.routing.usage import usage_from_tail

log = logging.getLogger("sluice.proxy")


@dataclass(slots=True, kw_only=True)
class Outgoing:
    """One validated, preprocessed request as its backend gets it, ready to be forwarded (and
    retried); what was decided about it is in its `RequestContext`.

    Not frozen, like every value a request hands along its path (RequestHead, Prepared,
    RouteRequest, Decision, ResponseHead, Reply, Usage): nothing changes them once made,
    and a frozen dataclass's __init__ sets each field through object.__setattr__, which
    cost ~60,000 of the proxy's ~1,155,000 instructions a request (callgrind)."""

    endpoint: Endpoint
    path: str
    body: bytes
    headers: Headers
    extra_headers: Headers  # added to the answer's headers
    answer_as_chat: bool = False  # the backend answers a completion to a chat request
    known_ids: tuple[str, ...] = ()  # engine response ids its answer names (to tag them)
    # Its fields but the prompt, as parsed (what the two hops of disaggregated serving read).
    fields: dict[str, Any] = field(default_factory=dict)
    # Two hops: the prefill engine's cached prompt tokens, written over the decode's figure.
    prefill_figure: PrefillFigure | None = None


@dataclass(slots=True)
class Attempt:
    """One request as one backend gets it, and how its answer comes back."""

    method: bytes
    target: str
    body: bytes
    headers: Headers
    extra: Headers  # added to the answer's headers
    endpoint: Endpoint
    converter: Converter | None = None  # rewrites the answer's body as it passes
    as_chat: bool = False  # a completion answered to a chat request (--forward tokens)


@dataclass(slots=True)
class Opened:
    """The client's reply, and where it comes from: a backend's answer on its way (its
    passage, the backend and the status it answered), or none for a reply of Sluice's own."""

    reply: Reply
    passage: Passage | None = None
    backend: Backend | None = None
    code: str = "error"
    endpoint: str = ""  # its endpoint's name (what its metrics are labelled by)


@dataclass(eq=False)
class Forwarder:
    """`upstream`: the connections to the backends; `relay_hub`: what relays bodies."""

    idle_timeout: float  # seconds allowed between two chunks of a streamed answer
    pool: BackendPool
    router: Router
    decider: Decider
    metrics: DoorMetrics
    upstream: UpstreamPool
    relay_hub: RelayHub

    async def open(self, outgoing: Outgoing, context: RequestContext) -> Opened:
        """Decide, then open the chosen backend's answer, or on a failure before it
        answered, the decision's first fallback's."""
        assert context.facts is not None
        timing = context.timing
        route_started = timing.routing_at = time.perf_counter()
        try:
            decision = await self.decider.decide(context.facts)
        except Refused as refusal:
            return Opened(error_reply(refusal))
        self.decided(decision, route_started, context)
        return await self.open_decided(decision, outgoing, context)

    @staticmethod
    def decided(decision: Decision, route_started: float, context: RequestContext) -> None:
        """The request's decision, and the time it took, noted."""
        timing = context.timing
        context.decision = decision
        timing.queue = decision.waited
        timing.routed_at = time.perf_counter()
        timing.route = timing.routed_at - route_started - decision.waited

    async def open_decided(
        self, decision: Decision, outgoing: Outgoing, context: RequestContext
    ) -> Opened:
        """The decision's backend's answer, or on a failure before it answered, its first
        fallback's."""
        for retried in (False, True):
            try:
                return await self.open_on(decision, outgoing, context)
            except UpstreamError as exc:
                log.warning("backend %s failed before answering: %s", decision.backend.url, exc)
                if retried or not decision.fallbacks:
                    return Opened(error_reply(exc))
                decision = self.decider.served_by(decision, decision.fallbacks[0])
                context.decision = decision
        raise AssertionError("unreachable: the second try returns")

    async def open_on(
        self, decision: Decision, outgoing: Outgoing, context: RequestContext
    ) -> Opened:
        """One try on the decision's backend. Raises `UpstreamError` while a retry is still
        possible (the backend's breaker hears of it)."""
        backend = decision.backend
        self.metrics.route_decisions.labels(self.router.policy.name, decision.reason).inc()
        timing = context.timing
        self.metrics.proxy_overhead_seconds.observe(time.perf_counter() - timing.started)
        route = f"{self.router.policy.name}:{decision.reason}"
        context.trace.routed(backend.url, route, context.request_id)
        extra = [
            (b"x-request-id", context.request_id),
            (b"x-sluice-backend", backend.url.encode()),
            (b"x-sluice-route", route.encode()),
            (b"server-timing", timing.header()),
            *outgoing.extra_headers,
        ]
        converter: Converter | None = (
            IdTagger(backend.id, outgoing.known_ids)
            if outgoing.endpoint.tags_response_ids
            else None
        )
        if outgoing.prefill_figure is not None:
            usage = PrefillCachedTokens(outgoing.prefill_figure)
            converter = usage if converter is None else Chained((converter, usage))
        attempt = Attempt(
            b"POST",
            outgoing.path,
            outgoing.body,
            outgoing.headers,
            extra,
            outgoing.endpoint,
            converter,
            outgoing.answer_as_chat,
        )
        started = partial(self.decider.started, decision)
        return await self._try(backend, attempt, timing, decision.model or ANY_MODEL, started)

    async def direct(self, backend: Backend, attempt: Attempt, timing: Timing) -> Opened:
        """One request to `backend` itself (502/504 on failure)."""
        timing.routed_at = time.perf_counter()
        attempt.extra.append((b"x-sluice-backend", backend.url.encode()))
        try:
            return await self._try(backend, attempt, timing, ANY_MODEL)
        except UpstreamError as exc:
            return Opened(error_reply(exc))

    async def _try(
        self,
        backend: Backend,
        attempt: Attempt,
        timing: Timing,
        model: str,
        started: Callable[[], None] = lambda: None,
    ) -> Opened:
        """`started()` when the answer's body begins: the engine runs the request."""
        try:
            response = await self.upstream.request(
                backend.url, attempt.target, attempt.headers, attempt.body, attempt.method
            )
        except UpstreamError as exc:
            self.count(backend, "error", exc, model)
            raise
        timing.sent_at, timing.answered_at = response.sent_at, time.perf_counter()
        timing.connected = not response.reused
        idle, hub, extra = self.idle_timeout, self.relay_hub, attempt.extra
        try:
            if attempt.as_chat:
                reply, passage = await chat_reply_from(response, extra, idle, hub, started=started)
            else:
                reply, passage = await reply_from(
                    response, extra, idle, hub, attempt.converter, attempt.endpoint, started=started
                )
        except UpstreamError as exc:
            self.count(backend, str(response.status_code), exc, model)
            await response.release()
            raise
        except BaseException:  # cancelled: the client left while its answer was read
            await response.release()
            raise
        return Opened(reply, passage, backend, str(response.status_code), attempt.endpoint.name)

    async def close(self, opened: Opened | None, context: RequestContext | None = None) -> None:
        """After the reply went out, however it went (`opened` None: it was given up before
        one was made): the backend's connection given back (or closed), its breaker told,
        and the decision told the request ended."""
        try:
            if opened is not None and opened.passage is not None and opened.backend is not None:
                passage, backend = opened.passage, opened.backend
                if passage.untidy:
                    self.metrics.untidy_streams.labels(endpoint=opened.endpoint).inc()
                failure = passage.broken_by
                code = opened.code
                if failure is None and int(code) in FAULT_STATUSES:
                    failure = UpstreamError(UpstreamFault.STATUS, f"answered {code}")
                model = ANY_MODEL
                if context is not None and context.decision is not None:
                    model = context.decision.model or ANY_MODEL
                self.count(backend, code, failure, model)
                if context is not None:
                    context.usage = usage_from_tail(passage.tail)
                await passage.release()  # closed, if the answer did not end cleanly
        finally:
            if context is not None:
                self.decider.complete(context)

    def count(self, backend: Backend, code: str, failure: UpstreamError | None, model: str) -> None:
        self.metrics.backend_requests.labels(backend=backend.url, code=code).inc()
        if failure is None:
            self.pool.request_succeeded(backend, model)
        else:
            self.pool.request_failed(backend, trio.current_time(), str(failure), model)
