"""A routed request's way to a backend and back: route, open, relay, retry once, release.

`Forwarder.forward` asks the router for a backend (held at its pool's gate while every engine
is saturated), sends the request (forward.py), relays the answer (relay.py) and, when the
backend failed before answering, tries one other backend. Whatever happens, the router's
reservation is released with the usage the answer reported, and the backend's breaker hears
of the outcome. `Forwarder.direct` is the way of a request that belongs to one backend and
is no inference (a stored response's GET, DELETE or cancel): no routing, no retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import trio

from app.config import Settings
from app.fleet.backends import ANY_MODEL, Backend, BackendPool
from app.http.client import UpstreamPool
from app.http.exchange import Exchange
from app.http.fields import Headers
from app.http.relay_hub import RelayHub
from app.observe.metrics import Metrics
from app.observe.timing import Timing
from app.preprocess.endpoints import Endpoint
from app.proxy import errors
from app.proxy.forward import StreamBroken, UpstreamFailure, open_upstream
from app.proxy.relay import Converter, Relayed, relay, relay_as_chat
from app.proxy.response_ids import IdTagger
from app.routing.decider import Decider, RequestContext
from app.routing.decision import Decision
from app.routing.refusal import Refused
from app.routing.router import Router
from app.routing.usage import usage_from_tail

log = logging.getLogger("sluice.proxy")

# 5xx answers that mean the backend, not the request, is in trouble.
BACKEND_FAULT_STATUSES = frozenset({500, 502, 503, 504})


@dataclass(slots=True, kw_only=True)
class Outgoing:
    """One validated, preprocessed request as its backend gets it, ready to be forwarded (and
    retried); what was decided about it is in its `RequestContext`.

    Not frozen, like every value a request hands along its path (RequestHead, Prepared,
    RouteRequest, Decision, ResponseHead, Relayed, Usage): nothing changes them once made,
    and a frozen dataclass's __init__ sets each field through object.__setattr__, which
    cost ~60,000 of the proxy's ~1,155,000 instructions a request (callgrind)."""

    endpoint: Endpoint
    path: str
    body: bytes
    headers: Headers
    extra_headers: Headers  # added to the answer's headers
    answer_as_chat: bool = False  # the backend answers a completion to a chat request
    known_ids: tuple[str, ...] = ()  # engine response ids its answer names (to tag them)


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


@dataclass(eq=False)
class Forwarder:
    """`upstream`: the connections to the backends; `relay_hub`: what relays bodies."""

    settings: Settings
    pool: BackendPool
    router: Router
    decider: Decider
    metrics: Metrics
    upstream: UpstreamPool
    relay_hub: RelayHub

    async def forward(
        self, exchange: Exchange, outgoing: Outgoing, context: RequestContext
    ) -> None:
        """Decide, then try the chosen backend, and on a failure before it answered, the
        decision's first fallback; the decision hears how it ended (`complete`)."""
        assert context.facts is not None
        timing = context.timing
        route_started = timing.routing_at = time.perf_counter()
        verdict = await self.decider.decide(context.facts)
        if isinstance(verdict, Refused):
            await exchange.respond_client_error(verdict)
            return
        decision = context.decision = verdict
        timing.queue = decision.waited
        timing.routed_at = time.perf_counter()
        timing.route = timing.routed_at - route_started - decision.waited
        try:
            for retried in (False, True):
                try:
                    await self._exchange(exchange, decision, outgoing, context)
                    return
                except UpstreamFailure as exc:
                    log.warning("backend %s failed before answering: %s", decision.backend.url, exc)
                    if retried or not decision.fallbacks:
                        await exchange.respond_client_error(errors.upstream_failure(exc))
                        return
                    decision = self.decider.served_by(decision, decision.fallbacks[0])
                    context.decision = decision
                except StreamBroken as exc:
                    # The client has part of an answer that cannot be finished: the server
                    # closes its connection, which is how HTTP says the answer is incomplete.
                    log.warning("backend %s broke off its answer: %s", decision.backend.url, exc)
                    return
        finally:
            self.decider.complete(context)

    async def _exchange(
        self,
        exchange: Exchange,
        decision: Decision,
        outgoing: Outgoing,
        context: RequestContext,
    ) -> None:
        """One try on the decision's backend. Raises `UpstreamFailure` while a retry is still
        possible; the usage its answer reported is the context's."""
        backend = decision.backend
        self.metrics.route_decisions.labels(self.router.policy.name, decision.reason).inc()
        relayed: Relayed | None = None
        outcome = _Outcome()
        try:
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
            converter = (
                IdTagger(backend.id, outgoing.known_ids)
                if outgoing.endpoint.tags_response_ids
                else None
            )
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
            relayed = await self._try(exchange, backend, attempt, outcome, timing, started)
        finally:
            context.usage = usage_from_tail(relayed.tail) if relayed is not None else None
            self._count(backend, outcome, decision.model or ANY_MODEL)

    async def direct(
        self, exchange: Exchange, backend: Backend, attempt: Attempt, timing: Timing
    ) -> None:
        """Send one request to `backend` itself and relay its answer (502/504 on failure)."""
        timing.routed_at = time.perf_counter()
        outcome = _Outcome()
        attempt.extra.append((b"x-sluice-backend", backend.url.encode()))
        try:
            await self._try(exchange, backend, attempt, outcome, timing)
        except UpstreamFailure as exc:
            await exchange.respond_client_error(errors.upstream_failure(exc))
        except StreamBroken as exc:
            log.warning("backend %s broke off its answer: %s", backend.url, exc)
        finally:
            self._count(backend, outcome, ANY_MODEL)

    async def _try(
        self,
        exchange: Exchange,
        backend: Backend,
        attempt: Attempt,
        outcome: _Outcome,
        timing: Timing,
        started: Callable[[], None] = lambda: None,
    ) -> Relayed:
        """`started()` when the answer's body begins: the engine runs the request."""
        try:
            response = await open_upstream(
                self.upstream,
                backend.url,
                attempt.target,
                attempt.body,
                attempt.headers,
                attempt.method,
            )
        except UpstreamFailure as exc:
            outcome.broken = str(exc)
            raise
        timing.sent_at, timing.answered_at = response.sent_at, time.perf_counter()
        timing.connected = not response.reused
        outcome.code = str(response.status_code)
        if response.status_code in BACKEND_FAULT_STATUSES:
            outcome.broken = f"answered {response.status_code}"
        idle, hub, extra = self.settings.idle_timeout, self.relay_hub, attempt.extra
        try:
            if attempt.as_chat:
                relayed = await relay_as_chat(response, exchange, extra, idle, hub, started=started)
            else:
                relayed = await relay(
                    response,
                    exchange,
                    extra,
                    idle,
                    hub,
                    attempt.converter,
                    attempt.endpoint,
                    started=started,
                )
        except (StreamBroken, UpstreamFailure) as exc:
            outcome.broken = str(exc)
            raise
        finally:
            await response.release()
        if relayed.broken is not None:
            outcome.broken = relayed.broken
        if relayed.untidy:
            self.metrics.untidy_streams.labels(endpoint=attempt.endpoint.name).inc()
        return relayed

    def _count(self, backend: Backend, outcome: _Outcome, model: str) -> None:
        self.metrics.backend_requests.labels(backend=backend.url, code=outcome.code).inc()
        if outcome.broken is None:
            self.pool.request_succeeded(backend, model)
        else:
            self.pool.request_failed(backend, trio.current_time(), outcome.broken, model)


@dataclass(slots=True)
class _Outcome:
    code: str = "error"  # the backend's status, once it answered
    broken: str | None = None  # what went wrong on the backend's side, if anything
