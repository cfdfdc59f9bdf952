"""The proxy's handler: it dispatches each request, and answers the small GET endpoints.

It answers each `Exchange` the proxy's server (app/http/server.py) hands it: a request costs one
dict lookup to dispatch (app/preprocess/endpoints.py names every inference endpoint and how
its body is read). An inference request is read into its context by the `Reception` it
shares with the endpoint picker (its head, its key, its record and trace), and handed to
inference.py, which reads its body, has it preprocessed, decided and forwarded
(to_backend.py), and sends the reply; the Reception books it once the server is done with
it, however it ended (`Exchange.at_end`). Every error leaves as OpenAI-shaped JSON. With
`--api-keys` an inference request or a model list needs a listed key. A stored response's
own paths go to the engine that holds it (response_ids.py). With `--forward tokens` only
backends whose tokenizer was verified take traffic (app/fleet/tokenizer_check.py).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from app.errors import ClientError
from app.fleet.tokenizer_check import build_probe
from app.http.exchange import Exchange
from app.http.reply import error_reply
from app.observe.metrics import exposition_in_slices
from app.preprocess.arrival import Arrival, arrival
from app.preprocess.endpoints import ENDPOINTS, STORED, STORED_RESPONSES, Endpoint
from app.preprocess.reception import Reception
from app.proxy import errors
from app.proxy.inference import Inference
from app.proxy.response_ids import IdTagger, untag
from app.proxy.settings import ProxySettings
from app.proxy.to_backend import Attempt, Forwarder, Opened
from app.proxy.two_hops import TwoHops
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
        settings: ProxySettings,
        reception: Reception,
        forwarder: Forwarder,
        registry: CollectorRegistry,
        two_hops: TwoHops | None = None,
    ) -> None:
        """`reception` checks, preprocesses and books each request (as the endpoint picker's
        does); `forwarder` decides and takes it to a backend and back (`two_hops` instead
        while the pool has prefill or decode engines); `registry`: every room's metrics, for
        /metrics."""
        self.settings = settings
        self.reception = reception
        self.preprocessor = reception.preprocessor
        self.catalog = reception.catalog
        self.forwarder = forwarder
        self.pool = forwarder.pool
        self.router = forwarder.router
        self.registry = registry
        self.active_requests = 0  # what --max-connections bounds
        self.inference = Inference(settings, reception, forwarder, self.pool, two_hops)
        self.forward_tokens = settings.forward == "tokens"
        if self.forward_tokens:
            probe = build_probe(self.preprocessor.encode_plain, self.preprocessor.special_tokens())
            self.pool.require_tokenizer_match(probe)

    async def __call__(self, exchange: Exchange) -> None:
        path = exchange.path
        method = exchange.method
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            if method != "POST":
                await exchange.respond_error(errors.method_not_allowed(b"POST"))
                return
            if self.active_requests >= self.settings.max_connections:
                # Refused before reading the body: past the bound, memory stays flat.
                limit = self.settings.max_connections
                await exchange.respond_error(errors.overloaded(limit))
                return
            self.active_requests += 1
            try:
                await self.infer(exchange, path, endpoint)
            finally:
                self.active_requests -= 1
            return
        if path in GET_PATHS:
            if method not in ("GET", "HEAD"):
                await exchange.respond_error(errors.method_not_allowed(b"GET"))
                return
            if path == "/health":
                await self.health(exchange)
            elif path == "/metrics":
                content_type = b"text/plain; version=0.0.4; charset=utf-8"
                headers = [(b"content-type", content_type)]
                await exchange.respond(200, headers, await exposition_in_slices(self.registry))
            else:
                await self.models(exchange)
            return
        if path.startswith(STORED_RESPONSES):
            await self.stored_response(exchange, path)
            return
        await exchange.respond_error(errors.not_found(path))

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
            await exchange.respond_error(exc)
            return
        now = trio.current_time()
        backends = self.pool.backends
        directory = self.catalog.directory(backends)
        allowed = grant.allowed(directory) if grant else None
        cards = self.catalog.cards(directory, backends, now, allowed)
        if not cards and not self.pool.any_available(now):
            no_backend = refusal.no_backend(refusals=self.pool.tokenizer_refusals())
            await exchange.respond_error(no_backend)
            return
        await exchange.respond_json(200, {"object": "list", "data": cards})

    async def stored_response(self, exchange: Exchange, path: str) -> None:
        """GET or DELETE /v1/responses/{id}, POST .../cancel, GET .../input_items: on the
        engine that made it, found by the tag of the id Sluice handed out."""
        tagged, _, action = path[len(STORED_RESPONSES) :].partition("/")
        action = "/" + action if action else ""
        allowed = STORED_METHODS.get(action)
        if allowed is None:
            await exchange.respond_error(errors.not_found(path))
            return
        method = exchange.method.encode()
        if method not in allowed:
            await exchange.respond_error(errors.method_not_allowed(b", ".join(allowed)))
            return
        context, head = self.reception.arrive(exchange.headers, STORED.name)
        exchange.at_end = partial(self._depart, STORED, context)
        opened = await self._stored(exchange, tagged, action, method, context, head)
        try:
            await exchange.send(opened.reply)
        finally:
            await self.forwarder.close(opened)

    async def _stored(
        self,
        exchange: Exchange,
        tagged: str,
        action: str,
        method: bytes,
        context: RequestContext,
        head: Arrival,
    ) -> Opened:
        try:
            self.reception.grant(head)
            owner = untag(tagged)
            backend = self.pool.find(owner[1]) if owner is not None else None
            if owner is None or backend is None:
                raise errors.response_not_found(tagged)
            body = await exchange.read_body(self.settings.max_body_bytes)
        except ClientError as exc:
            return Opened(error_reply(exc))
        engine_id = owner[0]
        target = STORED_RESPONSES + engine_id + action
        query = exchange.target.partition(b"?")[2]
        if query:
            target += "?" + query.decode("latin-1")
        context.request_id = head.request_id or self.inference.new_request_id()
        headers = self.inference.upstream_headers(head, context)
        tagger = IdTagger(backend.id, (engine_id,))
        attempt = Attempt(method, target, body, headers, [], STORED, tagger)
        return await self.forwarder.direct(backend, attempt, context.timing)

    async def infer(self, exchange: Exchange, path: str, endpoint: Endpoint) -> None:
        context, head = self.reception.arrive(exchange.headers, endpoint.name)
        exchange.at_end = partial(self._depart, endpoint, context)
        await self.inference.answer(exchange, path, endpoint, context, head)

    def _depart(self, endpoint: Endpoint, context: RequestContext, exchange: Exchange) -> None:
        """Once the server is done with the exchange, however it ended: the request booked."""
        route = exchange.path if endpoint is not STORED else STORED_ROUTE
        method, path = exchange.method, exchange.path
        self.reception.depart(context, exchange, method, path, route, endpoint.name)
