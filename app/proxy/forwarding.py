"""A routed request's way to a backend and back: route, open, relay, retry once, release.

`Forwarder.forward` asks the router for a backend (held at its pool's gate while every engine
is saturated), sends the request (forward.py), relays the answer (relay.py) and, when the
backend failed before answering, tries one other backend. Whatever happens, the router's
reservation is released with the usage the answer reported, and the backend's breaker hears
of the outcome. `Forwarder.direct` is the way of a request that belongs to one backend and
is no inference (a stored response's GET, DELETE or cancel): no routing, no retry.
"""

from __future__ import annotations

import dataclasses
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
from app.observe.request_trace import RequestTrace
from app.proxy import errors
from app.proxy.endpoints import Endpoint
from app.proxy.forward import StreamBroken, UpstreamFailure, open_upstream
from app.proxy.relay import Converter, Relayed, relay, relay_as_chat
from app.proxy.response_ids import IdTagger
from app.routing.admission import Admission, Overloaded
from app.routing.decision import Decision, RouteRequest
from app.routing.router import Router
from app.routing.usage import usage_from_tail

log = logging.getLogger("sluice.proxy")

# 5xx answers that mean the backend, not the request, is in trouble.
BACKEND_FAULT_STATUSES = frozenset({500, 502, 503, 504})


@dataclass
class Timing:
    """How long each phase took (server-timing, the request log) and, for its trace's spans,
    when the phases met: perf_counter readings, 0.0 for a phase the request never reached
    (the last try's, after a retry)."""

    started: float
    template: float = 0.0
    tokenize: float = 0.0
    route: float = 0.0
    queue: float = 0.0  # held at the gate, every engine of its pool saturated
    read_at: float = 0.0  # its body read, preprocessing begins
    routing_at: float = 0.0  # preprocessed, it asks the router
    routed_at: float = 0.0  # a backend chosen: connecting and sending
    sent_at: float = 0.0  # sent: waiting for the first byte
    connected: bool = False  # a new connection was opened for it (else one kept alive)
    answered_at: float = 0.0  # the backend's head arrived: relaying

    def header(self) -> bytes:
        return b"template;dur=%.3f, tokenize;dur=%.3f, route;dur=%.3f, queue;dur=%.3f" % (
            self.template * 1000,
            self.tokenize * 1000,
            self.route * 1000,
            self.queue * 1000,
        )


@dataclass(slots=True)
class Outgoing:
    """One validated, preprocessed request, ready to be forwarded (and retried).

    Not frozen, like every value a request hands along its path (RequestHead, Prepared,
    RouteRequest, Decision, ResponseHead, Relayed, Usage): nothing changes them once made,
    and a frozen dataclass's __init__ sets each field through object.__setattr__, which
    cost ~60,000 of the proxy's ~1,155,000 instructions a request (callgrind)."""

    endpoint: Endpoint
    path: str
    body: bytes
    headers: Headers
    request_id: bytes
    route_request: RouteRequest
    timing: Timing
    extra_headers: Headers
    answer_as_chat: bool  # the backend answers a completion to what was a chat request
    admission: Admission  # its key's label (token budgets, accounting, fair queuing) and more
    tokens_per_minute: int | None  # the key's own limit (None: --tokens-per-minute)
    known_ids: tuple[str, ...] = ()  # engine response ids its answer names (to tag them)
    prompt_admitted: bool = True  # its prompt's tokens were taken from the key's budget

    @property
    def model(self) -> str | None:
        return self.route_request.model


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
    metrics: Metrics
    upstream: UpstreamPool
    relay_hub: RelayHub

    async def forward(self, exchange: Exchange, outgoing: Outgoing, trace: RequestTrace) -> None:
        tried: list[Backend] = []
        failure: UpstreamFailure | None = None
        while len(tried) < 2:
            route_started = outgoing.timing.routing_at = time.perf_counter()
            try:
                chosen = await self.router.choose(
                    outgoing.route_request, tuple(tried), outgoing.admission
                )
            except Overloaded as exc:
                await exchange.respond_client_error(exc)
                return
            if chosen is None:
                break
            decision = dataclasses.replace(chosen, reason="retry") if tried else chosen
            outgoing.timing.queue += decision.waited
            routed_at = outgoing.timing.routed_at = time.perf_counter()
            outgoing.timing.route += routed_at - route_started - decision.waited
            backend = decision.backend
            self.metrics.route_decisions.labels(self.router.policy.name, decision.reason).inc()
            tried.append(backend)
            try:
                await self._exchange(exchange, backend, decision, outgoing, trace)
                return
            except UpstreamFailure as exc:
                failure = exc
                log.warning("backend %s failed before answering: %s", backend.url, exc)
            except StreamBroken as exc:
                # The client has part of an answer that cannot be finished: the server
                # closes its connection, which is how HTTP says the answer is incomplete.
                log.warning("backend %s broke off its answer: %s", backend.url, exc)
                return
        if failure is None:
            no_backend = errors.no_backend(outgoing.model, self.pool.tokenizer_refusals())
            await exchange.respond_client_error(no_backend)
        else:
            await exchange.respond_client_error(errors.upstream_failure(failure))

    async def _exchange(
        self,
        exchange: Exchange,
        backend: Backend,
        decision: Decision,
        outgoing: Outgoing,
        trace: RequestTrace,
    ) -> None:
        """One try on one backend. Raises `UpstreamFailure` while a retry is still possible.

        `decision` was reserved by the router, which `release` gives back."""
        relayed: Relayed | None = None
        outcome = _Outcome()
        try:
            timing = outgoing.timing
            self.metrics.proxy_overhead_seconds.observe(time.perf_counter() - timing.started)
            route = f"{self.router.policy.name}:{decision.reason}"
            trace.routed(backend.url, route, outgoing.request_id)
            extra = [
                (b"x-request-id", outgoing.request_id),
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
            relayed = await self._try(
                exchange, backend, attempt, outcome, timing, partial(self.router.started, decision)
            )
        finally:
            usage = usage_from_tail(relayed.tail) if relayed is not None else None
            key = outgoing.admission.tenant
            self.router.release(
                decision, usage, key, outgoing.tokens_per_minute, outgoing.prompt_admitted
            )
            self._count(backend, outcome, outgoing.model or ANY_MODEL)

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
