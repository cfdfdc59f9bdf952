"""The proxy's handler: parse -> preprocess -> route -> forward, plus the small GET endpoints.

It answers each `Exchange` the proxy's server (app/http/server.py) hands it: a request costs one
dict lookup to dispatch, and a backend's answer is relayed by relay.py. Every error leaves as
OpenAI-shaped JSON. With `--api-keys` a completion or a model list needs a listed key
(api_keys.py); each request's model is resolved while it is preprocessed (404 for a model that
is not served, or not the key's), and it goes only to that model's pool. With `--forward tokens`
the backend gets Sluice's token ids (token_forwarding.py), only backends whose tokenizer was
verified take traffic (app/fleet/tokenizer_check.py), and chat answers are reshaped back.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import trio

from app.config import Settings
from app.fleet.backends import ANY_MODEL, Backend, BackendPool
from app.fleet.catalog import ModelCatalog
from app.fleet.tokenizer_check import build_probe
from app.http.client import UpstreamPool
from app.http.errors import ClientError
from app.http.exchange import Exchange
from app.http.fields import Headers
from app.http.relay_hub import RelayHub
from app.models import NO_MODEL
from app.observe.metrics import Metrics
from app.observe.request_log import CLIENT_GONE_STATUS
from app.observe.request_trace import RequestTrace
from app.preprocess.pipeline import Prepared, Preprocessor
from app.preprocess.request_bodies import Kind
from app.proxy import errors
from app.proxy.accounting import KeyLabels
from app.proxy.api_keys import KeyGrant, KeyTable, invalid_api_key, load_api_keys
from app.proxy.forward import (
    StreamBroken,
    UpstreamFailure,
    open_upstream,
    upstream_headers,
)
from app.proxy.relay import Relayed, relay, relay_as_chat
from app.proxy.token_forwarding import plan_forward
from app.routing.admission import Admission, Overloaded
from app.routing.decision import Decision, RouteRequest
from app.routing.router import Router, estimated_tokens
from app.routing.usage import usage_from_tail

log = logging.getLogger("sluice.proxy")

COMPLETION_PATHS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
}
GET_PATHS = frozenset({"/v1/models", "/health", "/metrics"})
# 5xx answers that mean the backend, not the request, is in trouble.
BACKEND_FAULT_STATUSES = frozenset({500, 502, 503, 504})
# How much of a body stands in for its prompt when a hash must route it unparsed (bail-out).
ROUTE_KEY_BYTES = 4096
# A client's own deadline, in seconds: ours, and the one the OpenAI SDKs send.
CLIENT_TIMEOUT_HEADERS = (b"x-request-timeout", b"x-stainless-timeout")


@dataclass
class Timing:
    started: float
    template: float = 0.0
    tokenize: float = 0.0
    route: float = 0.0
    queue: float = 0.0  # held at the gate, every engine of its pool saturated

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

    @property
    def model(self) -> str | None:
        return self.route_request.model


class ProxyApp:
    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        router: Router,
        upstream: UpstreamPool,
        preprocessor: Preprocessor,
        metrics: Metrics,
        catalog: ModelCatalog,
        relay_hub: RelayHub,
    ) -> None:
        self.settings = settings
        self.relay_hub = relay_hub
        self.preprocessor = preprocessor
        self.key_labels = KeyLabels()
        self.keys: KeyTable | None = (
            None if settings.api_keys is None else load_api_keys(settings.api_keys)
        )
        self.catalog = catalog
        self.pool = pool
        self.router = router
        self.policy = router.policy
        self.upstream = upstream
        self.metrics = metrics
        self.active_completions = 0  # what --max-connections bounds
        # Request ids this process makes: a random prefix and a count, unique without a
        # system call for 16 random bytes on every request.
        self._id_prefix = os.urandom(8).hex().encode()
        self._ids_made = 0
        self.forward_tokens = settings.forward == "tokens"
        if self.forward_tokens:
            probe = build_probe(preprocessor.encode_plain, preprocessor.special_tokens())
            pool.require_tokenizer_match(probe)

    def _new_request_id(self) -> bytes:
        self._ids_made += 1
        return b"%b%016x" % (self._id_prefix, self._ids_made)

    async def __call__(self, exchange: Exchange) -> None:
        path = exchange.path
        method = exchange.method
        kind = COMPLETION_PATHS.get(path)
        if kind is not None:
            if method != "POST":
                await exchange.respond_client_error(errors.method_not_allowed(b"POST"))
                return
            if self.active_completions >= self.settings.max_connections:
                # Refused before reading the body: past the bound, memory stays flat.
                limit = self.settings.max_connections
                await exchange.respond_client_error(errors.overloaded(limit))
                return
            self.active_completions += 1
            try:
                await self.completion(exchange, path, kind)
            finally:
                self.active_completions -= 1
            return
        if path in GET_PATHS:
            if method not in ("GET", "HEAD"):
                await exchange.respond_client_error(errors.method_not_allowed(b"GET"))
                return
            if path == "/health":
                await self.health(exchange)
            elif path == "/metrics":
                content_type = b"text/plain; version=0.0.4; charset=utf-8"
                headers = [(b"content-type", content_type)]
                await exchange.respond(200, headers, self.metrics.render())
            else:
                await self.models(exchange)
            return
        await exchange.respond_client_error(errors.not_found(path))

    async def health(self, exchange: Exchange) -> None:
        now = trio.current_time()
        healthy = sum(1 for b in self.pool.backends if b.takes_traffic(now))
        status = 200 if healthy else 503
        payload: dict[str, Any] = {
            "status": "ok" if healthy else "no healthy backend",
            "healthy_backends": healthy,
            "backends": len(self.pool.backends),
        }
        if self.forward_tokens:
            payload["unverified_backends"] = self.pool.tokenizer_refusals()
            if not healthy and payload["unverified_backends"]:
                payload["status"] = "no verified backend"
        await exchange.respond_json(status, payload)

    def grant(self, exchange: Exchange) -> KeyGrant | None:
        """The caller's grant with `--api-keys` (None without: the proxy is open); a 401
        `ClientError` when its key is missing or not listed."""
        if self.keys is None:
            return None
        grant = self.keys.find(exchange.header(b"authorization"))
        if grant is None:
            raise invalid_api_key()
        return grant

    async def models(self, exchange: Exchange) -> None:
        try:
            grant = self.grant(exchange)
        except ClientError as exc:
            await exchange.respond_client_error(exc)
            return
        now = trio.current_time()
        backends = self.pool.backends
        directory = self.catalog.directory(backends)
        allowed = grant.allowed(directory) if grant else None
        cards = self.catalog.cards(directory, backends, now, allowed)
        if not cards and not self.pool.any_available(now):
            no_backend = errors.no_backend(refusals=self.pool.tokenizer_refusals())
            await exchange.respond_client_error(no_backend)
            return
        await exchange.respond_json(200, {"object": "list", "data": cards})

    async def completion(self, exchange: Exchange, path: str, kind: Kind) -> None:
        timing = Timing(started=time.perf_counter())
        trace = self.metrics.traffic.trace(timing, kind)
        try:
            await self._complete(exchange, path, kind, timing, trace)
        finally:
            trace.finish(exchange)
            code = str(CLIENT_GONE_STATUS if exchange.status is None else exchange.status)
            self.metrics.requests.labels(model=trace.model or NO_MODEL, code=code).inc()

    async def _complete(
        self, exchange: Exchange, path: str, kind: Kind, timing: Timing, trace: RequestTrace
    ) -> None:
        directory = self.catalog.directory(self.pool.backends)
        try:
            grant = self.grant(exchange)
            body = await exchange.read_body(self.settings.max_body_bytes)
            prepared = await self.preprocessor.prepare(
                kind,
                body,
                models=directory,
                allowed=grant.allowed(directory) if grant else None,
            )
        except ClientError as exc:
            await exchange.respond_client_error(exc)
            return
        trace.prepared(prepared)
        timing.template = prepared.template_seconds
        timing.tokenize = prepared.tokenize_seconds
        model = prepared.model
        key = grant.label if grant else self.key_labels.label(exchange.header(b"authorization"))
        if prepared.token_ids is not None:
            self.metrics.prompt_tokens.labels(api_key=key, model=model or NO_MODEL).inc(
                len(prepared.token_ids)
            )

        request_id = exchange.header(b"x-request-id") or self._new_request_id()
        headers = upstream_headers(exchange.headers, request_id)
        body = prepared.forward_body or body
        route_key = prepared.prompt or body[:ROUTE_KEY_BYTES].decode("utf-8", "replace")
        session = exchange.header(b"x-session-id") or prepared.fields.get("user")
        route_request = RouteRequest(prepared.token_ids, route_key, _session_key(session), model)
        per_minute = grant.tokens_per_minute if grant else None
        try:
            self.router.admit(key, model, estimated_tokens(route_request), per_minute)
        except Overloaded as exc:
            await exchange.respond_client_error(exc)
            return
        extra_headers = [(b"x-sluice-prompt-tokens", _prompt_tokens_header(prepared))]
        as_chat = False
        if self.forward_tokens:
            plan = plan_forward(kind, path, body, prepared)
            path, body, as_chat = plan.path, plan.body, plan.answer_as_chat
            extra_headers.append((b"x-sluice-forward", plan.label.encode()))
        outgoing = Outgoing(
            path,
            body,
            headers,
            request_id,
            route_request,
            timing,
            extra_headers,
            as_chat,
            self._admission(exchange, grant, key, prepared.fields, timing),
            per_minute,
        )
        await self.forward(exchange, outgoing, trace)

    def _admission(
        self,
        exchange: Exchange,
        grant: KeyGrant | None,
        key: str,
        fields: dict[str, Any],
        timing: Timing,
    ) -> Admission:
        """Its tenant (the key's label) and weight, its priority band (the key's, or the
        body's `priority` as vLLM takes it, never above the key's), and when it stops
        waiting: --admission-timeout after it arrived, or sooner if the client says so."""
        priority = grant.priority if grant else 0
        asked = fields.get("priority")
        if isinstance(asked, int) and not isinstance(asked, bool):
            priority = max(priority, asked)
        timeout = self.settings.admission_timeout
        for name in CLIENT_TIMEOUT_HEADERS:
            seconds = _seconds(exchange.header(name))
            if seconds is not None:
                timeout = min(timeout, seconds)
                break
        elapsed = time.perf_counter() - timing.started
        deadline = trio.current_time() + timeout - elapsed
        return Admission(key, grant.weight if grant else 1.0, priority, deadline)

    async def forward(self, exchange: Exchange, outgoing: Outgoing, trace: RequestTrace) -> None:
        tried: list[Backend] = []
        failure: UpstreamFailure | None = None
        while len(tried) < 2:
            route_started = time.perf_counter()
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
            outgoing.timing.route += time.perf_counter() - route_started - decision.waited
            backend = decision.backend
            self.metrics.route_decisions.labels(self.policy.name, decision.reason).inc()
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
        code = "error"
        broken: str | None = None
        relayed: Relayed | None = None
        try:
            timing = outgoing.timing
            self.metrics.proxy_overhead_seconds.observe(time.perf_counter() - timing.started)
            try:
                response = await open_upstream(
                    self.upstream,
                    backend.url,
                    outgoing.path,
                    outgoing.body,
                    outgoing.headers,
                )
            except UpstreamFailure as exc:
                broken = str(exc)
                raise
            code = str(response.status_code)
            if response.status_code in BACKEND_FAULT_STATUSES:
                broken = f"answered {response.status_code}"
            route = f"{self.policy.name}:{decision.reason}"
            trace.routed(backend.url, route, outgoing.request_id)
            extra = [
                (b"x-request-id", outgoing.request_id),
                (b"x-sluice-backend", backend.url.encode()),
                (b"x-sluice-route", route.encode()),
                (b"server-timing", timing.header()),
                *outgoing.extra_headers,
            ]
            relay_answer = relay_as_chat if outgoing.answer_as_chat else relay
            try:
                relayed = await relay_answer(
                    response, exchange, extra, self.settings.idle_timeout, self.relay_hub
                )
                if relayed.broken is not None:
                    broken = relayed.broken
            except (StreamBroken, UpstreamFailure) as exc:
                broken = str(exc)
                raise
            finally:
                await response.release()
        finally:
            usage = usage_from_tail(relayed.tail) if relayed is not None else None
            key = outgoing.admission.tenant
            self.router.release(decision, usage, key, outgoing.tokens_per_minute)
            self.metrics.backend_requests.labels(backend=backend.url, code=code).inc()
            pool_model = outgoing.model or ANY_MODEL
            if broken is None:
                self.pool.request_succeeded(backend, pool_model)
            else:
                self.pool.request_failed(backend, trio.current_time(), broken, pool_model)


def _seconds(value: bytes | None) -> float | None:
    """A header's positive number of seconds, or None."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds > 0 and math.isfinite(seconds) else None


def _session_key(session: object) -> str | None:
    """`x-session-id` (bytes) or the body's `user` (any JSON): a string, or None."""
    if isinstance(session, bytes):
        return session.decode("latin-1")
    return session if isinstance(session, str) and session else None


def _prompt_tokens_header(prepared: Prepared) -> bytes:
    """The prompt's token count, or `estimated` when tokenization was skipped (bail-out)."""
    if prepared.token_ids is None:
        return b"estimated"
    return str(len(prepared.token_ids)).encode()
