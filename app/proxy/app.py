"""The proxy's handler: parse -> preprocess -> route -> forward, plus the small GET endpoints.

It answers each `Exchange` the proxy's server (app/http/server.py) hands it: a request costs one
dict lookup to dispatch (endpoints.py names every inference endpoint and how its body is
read), and forwarding.py takes it to a backend and back. Every error leaves as OpenAI-shaped
JSON. With `--api-keys` an inference request or a model list needs a listed key
(api_keys.py; `Authorization: Bearer`, or Anthropic's `x-api-key`); each request's model is
resolved while it is preprocessed (404 for a model that is not served, or not the key's),
and it goes only to that model's pool. A stored response, and a Responses request continuing
one, go to the engine that holds it (response_ids.py). With `--forward tokens` chat and
completion requests reach the backend as Sluice's token ids (token_forwarding.py), only
backends whose tokenizer was verified take traffic (app/fleet/tokenizer_check.py), and chat
answers are reshaped back.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import trio

from app.config import Settings
from app.fleet.catalog import ModelCatalog
from app.fleet.tokenizer_check import build_probe
from app.http.errors import ClientError
from app.http.exchange import Exchange
from app.http.fields import Headers
from app.models import NO_MODEL
from app.observe.access_log import AccessLog
from app.observe.request_log import CLIENT_GONE_STATUS
from app.observe.request_trace import RequestTrace
from app.observe.spans import Attributes, TraceContext
from app.observe.tracing import (
    TRACEPARENT,
    Tracer,
    parse_traceparent,
    start_trace,
    with_traceparent,
)
from app.preprocess.pipeline import Prepared, Preprocessor
from app.proxy import errors
from app.proxy.accounting import KeyLabels, credential
from app.proxy.api_keys import KeyGrant, KeyTable, invalid_api_key, load_api_keys
from app.proxy.endpoints import ENDPOINTS, RESPONSES, STORED, STORED_RESPONSES, Endpoint
from app.proxy.forward import upstream_headers
from app.proxy.forwarding import Attempt, Forwarder, Outgoing, Timing
from app.proxy.request_spans import request_spans
from app.proxy.response_ids import IdTagger, untag
from app.proxy.token_forwarding import plan_forward
from app.routing.admission import Admission, Overloaded
from app.routing.decision import RouteRequest
from app.routing.router import estimated_tokens

log = logging.getLogger("sluice.proxy")

GET_PATHS = frozenset({"/v1/models", "/health", "/metrics"})
STORED_ROUTE = STORED_RESPONSES + "{response_id}"  # its spans' name: no id in it
# What may be done to a stored response, by what follows its id in the path.
STORED_METHODS = {"": (b"GET", b"DELETE"), "/cancel": (b"POST",), "/input_items": (b"GET",)}
# How much of a body stands in for its prompt when a hash must route it unparsed (bail-out).
ROUTE_KEY_BYTES = 4096
# A client's own deadline, in seconds: ours, and the one the OpenAI SDKs send.
CLIENT_TIMEOUT_HEADERS = (b"x-request-timeout", b"x-stainless-timeout")


class ProxyApp:
    def __init__(
        self,
        settings: Settings,
        preprocessor: Preprocessor,
        catalog: ModelCatalog,
        forwarder: Forwarder,
        tracer: Tracer,
        access_log: AccessLog | None = None,
    ) -> None:
        """`forwarder` takes a prepared request to a backend and back (its pool, router and
        metrics are the proxy's too); `tracer` and `access_log` hear of each request."""
        self.settings = settings
        self.tracer = tracer
        self.access_log = access_log
        self.preprocessor = preprocessor
        self.key_labels = KeyLabels()
        self.keys: KeyTable | None = (
            None if settings.api_keys is None else load_api_keys(settings.api_keys)
        )
        self.catalog = catalog
        self.forwarder = forwarder
        self.pool = forwarder.pool
        self.router = forwarder.router
        self.metrics = forwarder.metrics
        self.active_requests = 0  # what --max-connections bounds
        # Request ids this process makes: a random prefix and a count, unique without a
        # system call for 16 random bytes on every request.
        self._id_prefix = os.urandom(8).hex().encode()
        self._ids_made = 0
        self.forward_tokens = settings.forward == "tokens"
        if self.forward_tokens:
            probe = build_probe(preprocessor.encode_plain, preprocessor.special_tokens())
            self.pool.require_tokenizer_match(probe)

    def _new_request_id(self) -> bytes:
        self._ids_made += 1
        return b"%b%016x" % (self._id_prefix, self._ids_made)

    async def __call__(self, exchange: Exchange) -> None:
        path = exchange.path
        method = exchange.method
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            if method != "POST":
                await exchange.respond_client_error(errors.method_not_allowed(b"POST"))
                return
            if self.active_requests >= self.settings.max_connections:
                # Refused before reading the body: past the bound, memory stays flat.
                limit = self.settings.max_connections
                await exchange.respond_client_error(errors.overloaded(limit))
                return
            self.active_requests += 1
            try:
                await self.infer(exchange, path, endpoint)
            finally:
                self.active_requests -= 1
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
        if path.startswith(STORED_RESPONSES):
            await self.stored_response(exchange, path)
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
        grant = self.keys.find(self._credential(exchange))
        if grant is None:
            raise invalid_api_key()
        return grant

    @staticmethod
    def _credential(exchange: Exchange) -> bytes | None:
        return credential(exchange.header(b"authorization"), exchange.header(b"x-api-key"))

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

    async def stored_response(self, exchange: Exchange, path: str) -> None:
        """GET or DELETE /v1/responses/{id}, POST .../cancel, GET .../input_items: on the
        engine that made it, found by the tag of the id Sluice handed out."""
        tagged, _, action = path[len(STORED_RESPONSES) :].partition("/")
        action = "/" + action if action else ""
        allowed = STORED_METHODS.get(action)
        if allowed is None:
            await exchange.respond_client_error(errors.not_found(path))
            return
        method = exchange.method.encode()
        if method not in allowed:
            await exchange.respond_client_error(errors.method_not_allowed(b", ".join(allowed)))
            return
        timing = Timing(started=time.perf_counter())
        trace = self.metrics.traffic.trace(timing, STORED.name)
        context = self._traced(exchange, trace)
        try:
            self.grant(exchange)
            owner = untag(tagged)
            backend = self.pool.find(owner[1]) if owner is not None else None
            if owner is None or backend is None:
                raise errors.response_not_found(tagged)
            body = await exchange.read_body(self.settings.max_body_bytes)
        except ClientError as exc:
            await exchange.respond_client_error(exc)
            self._finish(exchange, trace, STORED, timing, context)
            return
        engine_id = owner[0]
        target = STORED_RESPONSES + engine_id + action
        query = exchange.target.partition(b"?")[2]
        if query:
            target += "?" + query.decode("latin-1")
        _, headers = self._upstream_headers(exchange, context)
        attempt = Attempt(
            method, target, body, headers, [], STORED, IdTagger(backend.id, (engine_id,))
        )
        try:
            await self.forwarder.direct(exchange, backend, attempt, timing)
        finally:
            self._finish(exchange, trace, STORED, timing, context)

    async def infer(self, exchange: Exchange, path: str, endpoint: Endpoint) -> None:
        timing = Timing(started=time.perf_counter())
        trace = self.metrics.traffic.trace(timing, endpoint.name)
        context = self._traced(exchange, trace)
        try:
            await self._infer(exchange, path, endpoint, timing, trace, context)
        finally:
            self._finish(exchange, trace, endpoint, timing, context)

    def _traced(self, exchange: Exchange, trace: RequestTrace) -> TraceContext | None:
        """The request's trace with --otlp-endpoint: the caller's continued, or a new one.
        Without, the caller's traceparent goes to the engine as it came, and its trace id
        to the request log."""
        header = exchange.header(TRACEPARENT)
        if self.tracer.enabled:
            context = start_trace(header)
            trace.trace_id = context.trace_id
            return context
        if header is not None:
            parsed = parse_traceparent(header)
            trace.trace_id = parsed[0] if parsed is not None else None
        return None

    def _upstream_headers(
        self, exchange: Exchange, context: TraceContext | None
    ) -> tuple[bytes, Headers]:
        """The request's id (the client's x-request-id, or one made here) and the headers
        the engine gets."""
        request_id = exchange.header(b"x-request-id") or self._new_request_id()
        headers = upstream_headers(exchange.headers, request_id)
        return request_id, headers if context is None else with_traceparent(headers, context)

    def _finish(
        self,
        exchange: Exchange,
        trace: RequestTrace,
        endpoint: Endpoint,
        timing: Timing,
        context: TraceContext | None,
    ) -> None:
        """Count the request, log it, and hand its spans over: once, when it has ended."""
        trace.finish(exchange)
        code = CLIENT_GONE_STATUS if exchange.status is None else exchange.status
        model = trace.model or NO_MODEL
        self.metrics.requests.labels(model=model, code=str(code), endpoint=endpoint.name).inc()
        if context is not None:
            attributes: Attributes = {
                "http.request.method": exchange.method,
                "url.path": exchange.path,
                "http.response.status_code": code,
                "sluice.endpoint": endpoint.name,
            }
            if trace.model is not None:
                attributes["gen_ai.request.model"] = trace.model
            if trace.backend is not None:
                attributes["sluice.backend"] = trace.backend
            route = exchange.path if endpoint is not STORED else STORED_ROUTE
            name = f"{exchange.method} {route}"
            server, children = request_spans(name, timing, trace.ended, attributes)
            self.tracer.finish(context, server, children)
        if self.access_log is not None:
            # The seq the request log just gave it: the same record, the same number.
            self.access_log.write(trace.record(self.metrics.traffic.log.total))

    async def _infer(
        self,
        exchange: Exchange,
        path: str,
        endpoint: Endpoint,
        timing: Timing,
        trace: RequestTrace,
        context: TraceContext | None,
    ) -> None:
        kind = endpoint.kind
        directory = self.catalog.directory(self.pool.backends)
        try:
            grant = self.grant(exchange)
            body = await exchange.read_body(self.settings.max_body_bytes)
            timing.read_at = time.perf_counter()
            prepared = await self.preprocessor.prepare(
                kind,
                body,
                models=directory,
                allowed=grant.allowed(directory) if grant else None,
            )
            body = prepared.forward_body or body
            route_request = self._route_request(exchange, prepared, body)
            known_ids: tuple[str, ...] = ()
            if endpoint is RESPONSES:
                body, known_ids = self._follow_up(prepared, body, route_request)
        except ClientError as exc:
            await exchange.respond_client_error(exc)
            return
        trace.prepared(prepared)
        timing.template = prepared.template_seconds
        timing.tokenize = prepared.tokenize_seconds
        model = prepared.model
        key = grant.label if grant else self.key_labels.label(self._credential(exchange))
        if prepared.token_ids is not None:
            self.metrics.prompt_tokens.labels(api_key=key, model=model or NO_MODEL).inc(
                len(prepared.token_ids)
            )
        per_minute = grant.tokens_per_minute if grant else None
        # Without a prompt of Sluice's (embeddings, uploads), the engine's usage is charged.
        prompt_admitted = prepared.tokenize_path != "none"
        prompt_tokens = estimated_tokens(route_request) if prompt_admitted else 0
        try:
            self.router.admit(key, model, prompt_tokens, per_minute)
        except Overloaded as exc:
            await exchange.respond_client_error(exc)
            return
        request_id, headers = self._upstream_headers(exchange, context)
        extra_headers = [(b"x-sluice-prompt-tokens", _prompt_tokens_header(prepared))]
        as_chat = False
        if self.forward_tokens and kind in ("chat", "completion"):
            plan = plan_forward(kind, path, body, prepared)
            path, body, as_chat = plan.path, plan.body, plan.answer_as_chat
            extra_headers.append((b"x-sluice-forward", plan.label.encode()))
        outgoing = Outgoing(
            endpoint,
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
            known_ids,
            prompt_admitted,
        )
        await self.forwarder.forward(exchange, outgoing, trace)

    def _route_request(self, exchange: Exchange, prepared: Prepared, body: bytes) -> RouteRequest:
        route_key = prepared.prompt or body[:ROUTE_KEY_BYTES].decode("utf-8", "replace")
        session = exchange.header(b"x-session-id") or prepared.fields.get("user")
        return RouteRequest(prepared.token_ids, route_key, _session_key(session), prepared.model)

    def _follow_up(
        self, prepared: Prepared, body: bytes, route_request: RouteRequest
    ) -> tuple[bytes, tuple[str, ...]]:
        """A Responses request continuing a stored one (`previous_response_id`) goes to the
        engine that stores it, asked by the engine's own id: the body, and that id."""
        previous = prepared.fields.get("previous_response_id")
        owner = untag(previous) if isinstance(previous, str) else None
        if owner is None or not isinstance(previous, str):
            return body, ()
        engine_id, backend_id = owner
        backend = self.pool.find(backend_id)
        if backend is None:
            raise errors.response_not_found(previous, "previous_response_id")
        route_request.pinned = backend
        quoted = b'"%b"' % previous.encode()
        return body.replace(quoted, b'"%b"' % engine_id.encode(), 1), (engine_id,)

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
    """The prompt's token count, `estimated` when tokenization was skipped (bail-out), or
    `engine` when Sluice has no prompt of its own to count (embeddings, uploads, ...)."""
    if prepared.tokenize_path == "none":
        return b"engine"
    if prepared.token_ids is None:
        return b"estimated"
    return str(len(prepared.token_ids)).encode()
