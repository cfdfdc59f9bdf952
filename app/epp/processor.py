"""The endpoint picker's door: one ext_proc stream is one request through the gateway.

Envoy sends the request's headers, then its body; the picker asks the same decision as the
proxy (app/routing/decider.py) through the same `Reception` (app/preprocess/reception.py),
so a request is checked, preprocessed, admitted, held, routed and counted as it would be by
the proxy, and answers where it goes. Then Envoy sends the answer's headers and body, which
the picker follows: the endpoint that served it, its first byte (the engine runs it: held
requests may go), its usage at its end, its status; the decision hears it as from the proxy.

The order of one stream, in full-duplex streaming mode (the protocol's own): request headers
(held until the body is whole: the endpoint goes in the headers' answer), request body
chunks (given back whole after the headers' answer, as the mode requires), optional
trailers, then the response's headers, body chunks (each given back as it comes) and
trailers. In buffered mode the headers are answered at once and the endpoint goes with the
body's answer. Anything else (a GET, a path that is no inference) is routed by load alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from app.epp import ext_proc
from app.epp.grpc_server import MessageStream
from app.epp.grpc_wire import GrpcError, StatusCode
from app.epp.messages import FULL_DUPLEX_STREAMED, ProcessingRequest
from app.errors import ClientError, Refused, SluiceError, WireError, answer_for
from app.fleet.backends import ANY_MODEL, FAULT_STATUSES, Backend
from app.fleet.pool import BackendPool
from app.preprocess.endpoints import ENDPOINTS, Endpoint
from app.preprocess.reception import Reception
from app.routing.decider import Decider, RequestContext, RequestFacts
from app.routing.decision import Decision, RouteRequest
from app.routing.metrics import DoorMetrics
from app.routing.refusal import no_backend
from app.routing.usage import TAIL_BYTES, usage_from_tail

log = logging.getLogger("sluice.epp")

OTHER = Endpoint("other", "model", ())  # a request that is no inference: routed by load


class _StreamEnded(WireError):
    """Envoy ended the stream before the request was whole: its client left."""


@dataclass(slots=True)
class _Answer:
    """The answer as the client got it through Envoy (what the request log reads)."""

    status: int | None = None
    first_byte_at: float | None = None
    complete: bool = False


@dataclass(slots=True)
class _Stream:
    """One request's state on its ext_proc stream."""

    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    duplex: bool = True
    subset: frozenset[str] | None = None
    body: list[bytes] = field(default_factory=list)
    size: int = 0
    answer: _Answer = field(default_factory=_Answer)
    tail: bytes = b""
    trailers: bool = False  # the request ended with trailers, still to be answered
    test_selection: bool = False


@dataclass(eq=False)
class EndpointPicker:
    reception: Reception
    decider: Decider
    pool: BackendPool
    metrics: DoorMetrics
    max_body_bytes: int

    async def process(self, stream: MessageStream) -> None:
        """The ext_proc `Process` RPC: one HTTP request through the gateway."""
        first = await _receive(stream)
        if first is None:
            return
        if first.WhichOneof("request") != "request_headers":
            raise GrpcError(
                StatusCode.INVALID_ARGUMENT, "an ext_proc stream begins with request headers"
            )
        stream.send_initial_metadata()  # while the body comes: the endpoint goes out sooner
        state = _Stream(
            headers=ext_proc.headers_of(first.request_headers),
            duplex=first.protocol_config.request_body_mode == FULL_DUPLEX_STREAMED,
            subset=ext_proc.subset_hint(first),
        )
        state.test_selection = _header(state.headers, ext_proc.TEST_SELECTION) is not None
        path = (_header(state.headers, b":path") or b"/").split(b"?")[0].decode("latin-1")
        method = (_header(state.headers, b":method") or b"GET").decode("latin-1")
        endpoint = ENDPOINTS.get(path) if method == "POST" else None
        context, head = self.reception.arrive(state.headers, (endpoint or OTHER).name)
        context.request_id = head.request_id or b""  # the client's, or the one Envoy made
        try:
            await self._request(stream, first, state, endpoint, context, head)
        except _StreamEnded:
            pass
        finally:
            self.decider.complete(context)
            name = (endpoint or OTHER).name
            self.reception.depart(context, state.answer, method, path, path, name)

    async def _request(
        self,
        stream: MessageStream,
        first: Any,
        state: _Stream,
        endpoint: Endpoint | None,
        context: RequestContext,
        head: Any,
    ) -> None:
        if not state.duplex:
            # Buffered (or headers only): Envoy waits for this before it sends the body.
            await stream.send(ext_proc.proceed("request_headers"))
        phase = "request_headers"
        if not first.request_headers.end_of_stream:
            phase = "request_body"
        try:
            if phase == "request_body":
                await self._read_body(stream, state)
            body = b"".join(state.body)
            body_at = time.perf_counter()
            # Bad input, a subset with nothing eligible, a budget spent, nothing to serve it.
            facts = await self._facts(state, endpoint, context, head, body)
            if self.pool.disaggregated:  # Envoy sends a request whole: to an engine doing both
                only = facts.route.only
                whole = [b for b in self.pool.backends if b.role == "both"]
                facts.route.only = frozenset(b for b in whole if only is None or b in only)
            started = time.perf_counter()
            decision = context.decision = await self.decider.decide(facts)
        except (ClientError, Refused) as refusal:
            await self._refuse(stream, state, refusal)
            return
        self._count_decision(context, decision, started)
        await self._route(stream, state, decision, phase, body, context, body_at)
        await self._follow_answer(stream, state, context)

    async def _read_body(self, stream: MessageStream, state: _Stream) -> None:
        """The request body, whole. Raises a 413 `ClientError` past --max-body-bytes."""
        while True:
            message = await _receive(stream)
            if message is None:
                raise _StreamEnded
            kind = message.WhichOneof("request")
            if kind == "request_trailers":
                state.trailers = True
                return
            if kind != "request_body":
                raise GrpcError(
                    StatusCode.INVALID_ARGUMENT, f"{kind} while the request body was awaited"
                )
            chunk = message.request_body.body
            state.size += len(chunk)
            if state.size > self.max_body_bytes:
                raise ClientError(
                    f"Request body exceeds {self.max_body_bytes} bytes.",
                    code="request_too_large",
                    status=413,
                )
            state.body.append(chunk)
            if message.request_body.end_of_stream:
                return

    async def _facts(
        self,
        state: _Stream,
        endpoint: Endpoint | None,
        context: RequestContext,
        head: Any,
        body: bytes,
    ) -> RequestFacts:
        grant = self.reception.grant(head)
        if endpoint is None:
            context.facts = RequestFacts(route=RouteRequest())
        else:
            await self.reception.prepare(context, head, grant, endpoint.kind, body)
        facts = context.facts
        assert facts is not None
        allowed = state.subset
        selection = _header(state.headers, ext_proc.TEST_SELECTION)
        if selection is not None:
            allowed = frozenset(s.strip() for s in selection.decode().split(",") if s.strip())
        if allowed is not None:
            only = frozenset(b for b in self.pool.backends if b.endpoint in allowed)
            if not only:
                raise no_backend(facts.model)
            facts.route.only = only
        return facts

    def _count_decision(self, context: RequestContext, decision: Decision, started: float) -> None:
        now = time.perf_counter()
        timing = context.timing
        timing.queue = decision.waited
        timing.routing_at, timing.routed_at = started, now
        timing.route = now - started - decision.waited
        policy = self.decider.router.policy.name
        self.metrics.route_decisions.labels(policy, decision.reason).inc()
        self.metrics.proxy_overhead_seconds.observe(now - timing.started - decision.waited)
        route = f"{policy}:{decision.reason}"
        context.trace.routed(decision.backend.url, route, context.request_id)

    async def _route(
        self,
        stream: MessageStream,
        state: _Stream,
        decision: Decision,
        phase: str,
        body: bytes,
        context: RequestContext,
        body_at: float,
    ) -> None:
        """The endpoints out; the picker's own time measured as they leave (the body's
        last byte in to here, less rendering, tokenizing and the time held for room)."""
        span = context.span
        endpoints = [decision.backend.endpoint, *(b.endpoint for b in decision.fallbacks)]
        route = f"{self.decider.router.policy.name}:{decision.reason}"
        extra = [("x-sluice-route", route.encode())]
        if span is not None:  # the engine continues the request's trace
            extra.append(("traceparent", span.upstream_traceparent()))
        if not state.duplex:
            await stream.send(ext_proc.picked(endpoints, extra, phase=phase))
            self._decided(context, decision, body_at)
            if state.trailers:
                await stream.send(ext_proc.proceed("request_trailers"))
            return
        await stream.send(ext_proc.picked(endpoints, extra, phase="request_headers"))
        self._decided(context, decision, body_at)
        if phase == "request_body":
            await stream.send(ext_proc.streamed("request_body", body, not state.trailers))
        if state.trailers:
            await stream.send(ext_proc.proceed("request_trailers"))

    def _decided(self, context: RequestContext, decision: Decision, body_at: float) -> None:
        timing = context.timing
        own = time.perf_counter() - body_at - timing.template - timing.tokenize - decision.waited
        self.metrics.epp_decision_seconds.observe(own)

    async def _follow_answer(
        self, stream: MessageStream, state: _Stream, context: RequestContext
    ) -> None:
        """The response's headers and body, as Envoy passes them on."""
        # What the backend's breaker hears: nothing while no answer came (the client may
        # have left; the health checks watch a backend that is down), then how it answered.
        failure: str | None = None
        answered = False
        decision = context.decision
        assert decision is not None
        code = "error"
        try:
            while (data := await stream.receive()) is not None:
                chunk = ext_proc.response_body_chunk(data)  # most messages: read by hand
                if chunk is not None:
                    await self._body_chunk(stream, state, decision, *chunk)
                    continue
                message = _parse(data)
                kind = message.WhichOneof("request")
                if kind == "response_headers":
                    decision = context.decision = self._served(message, decision)
                    status = await self._answer_headers(stream, state, context, message)
                    state.answer.status, code, answered = status, str(status), True
                    if status in FAULT_STATUSES:
                        failure = f"answered {status}"
                elif kind == "response_body":
                    body = message.response_body
                    await self._body_chunk(stream, state, decision, body.body, body.end_of_stream)
                elif kind == "response_trailers":
                    await stream.send(ext_proc.proceed("response_trailers"))
                    state.answer.complete = True
                elif kind == "request_trailers":
                    await stream.send(ext_proc.proceed("request_trailers"))
        finally:
            context.usage = usage_from_tail(state.tail) if state.tail else None
            backend = decision.backend
            self.metrics.backend_requests.labels(backend=backend.url, code=code).inc()
            model = decision.model or ANY_MODEL
            if failure is not None:
                self.pool.request_failed(backend, trio.current_time(), failure, model)
            elif answered:
                self.pool.request_succeeded(backend, model)

    async def _answer_headers(
        self, stream: MessageStream, state: _Stream, context: RequestContext, message: Any
    ) -> int:
        """The response's headers go on with what the proxy's answers carry too (the
        design's contract); their status."""
        decision = context.decision
        assert decision is not None
        headers = ext_proc.headers_of(message.response_headers)
        route = f"{self.decider.router.policy.name}:{decision.reason}"
        extra = [
            ("x-sluice-backend", decision.backend.url.encode()),
            ("x-sluice-route", route.encode()),
            ("server-timing", context.timing.header()),
        ]
        if context.request_id:
            extra.append(("x-request-id", context.request_id))
        if state.test_selection:
            extra.append((ext_proc.TEST_SERVED, decision.backend.endpoint.encode()))
        await stream.send(ext_proc.proceed("response_headers", extra))
        if message.response_headers.end_of_stream:
            state.answer.complete = True
        return int(_header(headers, b":status") or b"0")

    async def _body_chunk(
        self, stream: MessageStream, state: _Stream, decision: Decision, chunk: bytes, end: bool
    ) -> None:
        if chunk:
            if state.answer.first_byte_at is None:
                state.answer.first_byte_at = time.perf_counter()
                self.decider.started(decision)
            state.tail = (state.tail + chunk)[-TAIL_BYTES:]
        if end:
            state.answer.complete = True
        if state.duplex:
            await stream.send(ext_proc.streamed("response_body", chunk, end))
        else:
            await stream.send(ext_proc.proceed("response_body"))

    def _served(self, message: Any, decision: Decision) -> Decision:
        """The decision, moved to the endpoint that served the answer when Envoy retried on
        a fallback; the primary's failure reaches its breaker."""
        served = ext_proc.served_endpoint(message)
        if served is None or served == decision.backend.endpoint:
            return decision
        backend = _find(decision.fallbacks, served)
        if backend is None:
            return decision
        failed = decision.backend
        model = decision.model or ANY_MODEL
        self.pool.request_failed(failed, trio.current_time(), "the gateway retried", model)
        return self.decider.served_by(decision, backend)

    async def _refuse(self, stream: MessageStream, state: _Stream, error: SluiceError) -> None:
        answer = answer_for(error)
        state.answer.status = answer.status
        state.answer.complete = True
        state.answer.first_byte_at = time.perf_counter()
        await stream.send(ext_proc.immediate(answer.status, answer.body, answer.headers))


def _find(backends: tuple[Backend, ...], endpoint: str) -> Backend | None:
    return next((b for b in backends if b.endpoint == endpoint), None)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((value for key, value in headers if key == name), None)


async def _receive(stream: MessageStream) -> Any:
    data = await stream.receive()
    return None if data is None else _parse(data)


def _parse(data: bytes) -> Any:
    try:
        return ProcessingRequest.FromString(data)
    except Exception as exc:  # protobuf's DecodeError: a message that is not ext_proc's
        raise GrpcError(
            StatusCode.INVALID_ARGUMENT, f"not an ext_proc ProcessingRequest: {exc}"
        ) from None
