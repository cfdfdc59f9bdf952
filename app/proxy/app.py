"""The proxy's handler: arrive -> preprocess -> decide -> forward, plus the small GET endpoints.

It answers each `Exchange` the proxy's server (app/http/server.py) hands it: a request costs one
dict lookup to dispatch (app/preprocess/endpoints.py names every inference endpoint and how
its body is read); the `Reception` it shares with the endpoint picker reads its head, checks
its key, preprocesses it and books it; forwarding.py asks the decision and takes it to a
backend and back. Every error leaves as OpenAI-shaped JSON. With `--api-keys` an inference
request or a model list needs a listed key; each request's model is resolved while it is
preprocessed (404 for a model that is not served, or not the key's), and it goes only to
that model's pool. A stored response, and a Responses request continuing
one, go to the engine that holds it (response_ids.py). With `--forward tokens` chat and
completion requests reach the backend as Sluice's token ids (token_forwarding.py), only
backends whose tokenizer was verified take traffic (app/fleet/tokenizer_check.py), and chat
answers are reshaped back.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import trio

from app.config import Settings
from app.fleet.tokenizer_check import build_probe
from app.http.errors import ClientError
from app.http.exchange import Exchange
from app.http.fields import Headers
from app.observe.tracing import with_traceparent
from app.preprocess.arrival import Arrival, arrival
from app.preprocess.endpoints import ENDPOINTS, RESPONSES, STORED, STORED_RESPONSES, Endpoint
from app.preprocess.pipeline import Prepared
from app.preprocess.reception import Reception
from app.proxy import errors
from app.proxy.forward import upstream_headers
from app.proxy.forwarding import Attempt, Forwarder, Outgoing
from app.proxy.response_ids import IdTagger, untag
from app.proxy.token_forwarding import plan_forward
from app.routing import refusal
from app.routing.decider import RequestContext

log = logging.getLogger("sluice.proxy")

GET_PATHS = frozenset({"/v1/models", "/health", "/metrics"})
STORED_ROUTE = STORED_RESPONSES + "{response_id}"  # its spans' name: no id in it
# What may be done to a stored response, by what follows its id in the path.
STORED_METHODS = {"": (b"GET", b"DELETE"), "/cancel": (b"POST",), "/input_items": (b"GET",)}


class ProxyApp:
    def __init__(
        self,
        settings: Settings,
        reception: Reception,
        forwarder: Forwarder,
    ) -> None:
        """`reception` checks, preprocesses and books each request (as the endpoint picker's
        does); `forwarder` decides and takes it to a backend and back."""
        self.settings = settings
        self.reception = reception
        self.preprocessor = reception.preprocessor
        self.catalog = reception.catalog
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
            probe = build_probe(self.preprocessor.encode_plain, self.preprocessor.special_tokens())
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

    async def models(self, exchange: Exchange) -> None:
        try:
            grant = self.reception.grant(arrival(exchange.headers))
        except ClientError as exc:
            await exchange.respond_client_error(exc)
            return
        now = trio.current_time()
        backends = self.pool.backends
        directory = self.catalog.directory(backends)
        allowed = grant.allowed(directory) if grant else None
        cards = self.catalog.cards(directory, backends, now, allowed)
        if not cards and not self.pool.any_available(now):
            no_backend = refusal.no_backend(refusals=self.pool.tokenizer_refusals())
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
        context, head = self.reception.arrive(exchange.headers, STORED.name)
        try:
            self.reception.grant(head)
            owner = untag(tagged)
            backend = self.pool.find(owner[1]) if owner is not None else None
            if owner is None or backend is None:
                raise errors.response_not_found(tagged)
            body = await exchange.read_body(self.settings.max_body_bytes)
        except ClientError as exc:
            await exchange.respond_client_error(exc)
            self._depart(exchange, STORED, context)
            return
        engine_id = owner[0]
        target = STORED_RESPONSES + engine_id + action
        query = exchange.target.partition(b"?")[2]
        if query:
            target += "?" + query.decode("latin-1")
        headers = self._upstream_headers(exchange, head, context)
        attempt = Attempt(
            method, target, body, headers, [], STORED, IdTagger(backend.id, (engine_id,))
        )
        try:
            await self.forwarder.direct(exchange, backend, attempt, context.timing)
        finally:
            self._depart(exchange, STORED, context)

    async def infer(self, exchange: Exchange, path: str, endpoint: Endpoint) -> None:
        context, head = self.reception.arrive(exchange.headers, endpoint.name)
        try:
            await self._infer(exchange, path, endpoint, context, head)
        finally:
            self._depart(exchange, endpoint, context)

    async def _infer(
        self,
        exchange: Exchange,
        path: str,
        endpoint: Endpoint,
        context: RequestContext,
        head: Arrival,
    ) -> None:
        kind = endpoint.kind
        try:
            grant = self.reception.grant(head)
            body = await exchange.read_body(self.settings.max_body_bytes)
            prepared = await self.reception.prepare(context, head, grant, kind, body)
            body = prepared.forward_body or body
            known_ids: tuple[str, ...] = ()
            if endpoint is RESPONSES:
                body, known_ids = self._follow_up(prepared, body, context)
        except ClientError as exc:
            await exchange.respond_client_error(exc)
            return
        headers = self._upstream_headers(exchange, head, context)
        extra_headers = [(b"x-sluice-prompt-tokens", _prompt_tokens_header(prepared))]
        as_chat = False
        if self.forward_tokens and kind in ("chat", "completion"):
            plan = plan_forward(kind, path, body, prepared)
            path, body, as_chat = plan.path, plan.body, plan.answer_as_chat
            extra_headers.append((b"x-sluice-forward", plan.label.encode()))
        outgoing = Outgoing(
            endpoint=endpoint,
            path=path,
            body=body,
            headers=headers,
            extra_headers=extra_headers,
            answer_as_chat=as_chat,
            known_ids=known_ids,
        )
        await self.forwarder.forward(exchange, outgoing, context)

    def _upstream_headers(
        self, exchange: Exchange, head: Arrival, context: RequestContext
    ) -> Headers:
        """The headers the engine gets, with the request's id: the client's x-request-id,
        or one made here (the context's from now on)."""
        context.request_id = head.request_id or self._new_request_id()
        headers = upstream_headers(exchange.headers, context.request_id)
        return headers if context.span is None else with_traceparent(headers, context.span)

    def _depart(self, exchange: Exchange, endpoint: Endpoint, context: RequestContext) -> None:
        route = exchange.path if endpoint is not STORED else STORED_ROUTE
        self.reception.depart(
            context, exchange, exchange.method, exchange.path, route, endpoint.name
        )

    def _follow_up(
        self, prepared: Prepared, body: bytes, context: RequestContext
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
        assert context.facts is not None
        context.facts.route.only = frozenset((backend,))
        quoted = b'"%b"' % previous.encode()
        return body.replace(quoted, b'"%b"' % engine_id.encode(), 1), (engine_id,)


def _prompt_tokens_header(prepared: Prepared) -> bytes:
    """The prompt's token count, `estimated` when tokenization was skipped (bail-out), or
    `engine` when Sluice has no prompt of its own to count (embeddings, uploads, ...)."""
    if prepared.tokenize_path == "none":
        return b"engine"
    if prepared.token_ids is None:
        return b"estimated"
    return str(len(prepared.token_ids)).encode()
