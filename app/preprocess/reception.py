"""A request's life beside the decision, the same at both doors: it arrives (its head read
once, its record and trace begun), it is prepared (its key checked, its body preprocessed,
its facts made for the decision), and it departs (counted, logged, its spans handed over).

The proxy (app/proxy/app.py) and the endpoint picker (app/epp/) each hold one `Reception`:
what they do differently is only how bytes come and go.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio

from app.fleet.catalog import ModelCatalog
from app.fleet.pool import BackendPool
from app.http.fields import Headers
from app.models import NO_MODEL
from app.observe.access_log import AccessLog
from app.observe.request_log import CLIENT_GONE_STATUS
from app.observe.request_spans import request_spans
from app.observe.request_trace import AnswerLike, TrafficRecorder
from app.observe.spans import Attributes
from app.observe.timing import Timing
from app.observe.tracing import Tracer, parse_traceparent, start_trace
from app.preprocess.accounting import KeyLabels
from app.preprocess.api_keys import KeyGrant, KeyTable, invalid_api_key, load_api_keys
from app.preprocess.arrival import Arrival, arrival, request_facts
from app.preprocess.metrics import PreprocessMetrics
from app.preprocess.pipeline import Prepared, Preprocessor
from app.preprocess.request_bodies import Kind
from app.preprocess.settings import PreprocessSettings
from app.routing.decider import RequestContext


@dataclass(eq=False)
class Reception:
    settings: PreprocessSettings
    preprocessor: Preprocessor
    catalog: ModelCatalog
    pool: BackendPool
    metrics: PreprocessMetrics
    traffic: TrafficRecorder
    tracer: Tracer
    access_log: AccessLog | None = None
    key_labels: KeyLabels = field(init=False, default_factory=KeyLabels)
    keys: KeyTable | None = field(init=False)

    def __post_init__(self) -> None:
        api_keys = self.settings.api_keys
        self.keys = None if api_keys is None else load_api_keys(api_keys)

    def arrive(self, headers: Headers, endpoint: str) -> tuple[RequestContext, Arrival]:
        """Its context (timing from now, its record for the dashboard, its trace: the
        caller's continued, or a new one with --otlp-endpoint) and what its head says.
        Without --otlp-endpoint the caller's trace id still goes to the request log."""
        timing = Timing(started=time.perf_counter())
        trace = self.traffic.trace(timing, endpoint)
        head = arrival(headers)
        span = None
        if self.tracer.enabled:
            span = start_trace(head.traceparent)
            trace.trace_id = span.trace_id
        elif head.traceparent is not None:
            parsed = parse_traceparent(head.traceparent)
            trace.trace_id = parsed[0] if parsed is not None else None
        arrived_at = trio.current_time()
        context = RequestContext(timing=timing, trace=trace, span=span, arrived_at=arrived_at)
        return context, head

    def grant(self, head: Arrival) -> KeyGrant | None:
        """The caller's grant with `--api-keys` (None without: Sluice is open); a 401
        `ClientError` when its key is missing or not listed."""
        if self.keys is None:
            return None
        grant = self.keys.find(head.credential)
        if grant is None:
            raise invalid_api_key()
        return grant

    async def prepare(
        self,
        context: RequestContext,
        head: Arrival,
        grant: KeyGrant | None,
        kind: Kind,
        body: bytes,
    ) -> tuple[Prepared, bytes]:
        """Preprocess the body (a `ClientError` for a bad one, an unknown model, a model not
        the key's) and set the request's facts for the decision: the preprocessed request,
        and the body its backend gets (the client's, or rewritten: an alias's model)."""
        context.timing.read_at = time.perf_counter()
        directory = self.catalog.directory(self.pool.backends)
        prepared = await self.preprocessor.prepare(
            kind,
            body,
            models=directory,
            allowed=grant.allowed(directory) if grant else None,
        )
        context.trace.prepared(prepared)
        context.timing.template = prepared.template_seconds
        context.timing.tokenize = prepared.tokenize_seconds
        tenant = grant.label if grant else self.key_labels.label(head.credential)
        if prepared.token_ids is not None:
            model = prepared.model or NO_MODEL
            self.metrics.prompt_tokens.labels(api_key=tenant, model=model).inc(
                len(prepared.token_ids)
            )
        context.facts = request_facts(
            head,
            prepared,
            prepared.forward_body or body,
            grant,
            tenant,
            context.arrived_at,
            self.settings.admission_timeout,
        )
        return prepared, prepared.forward_body or body

    def depart(
        self,
        context: RequestContext,
        answer: AnswerLike,
        method: str,
        path: str,
        route: str,
        endpoint: str,
    ) -> None:
        """Count the request, log it, and hand its spans over: once, when it has ended.
        `route` names its path in its span's name (a stored response's, without its id)."""
        trace, span = context.trace, context.span
        trace.finish(answer)
        code = CLIENT_GONE_STATUS if answer.status is None else answer.status
        model = trace.model or NO_MODEL
        self.metrics.requests.labels(model=model, code=str(code), endpoint=endpoint).inc()
        if span is not None:
            attributes: Attributes = {
                "http.request.method": method,
                "url.path": path,
                "http.response.status_code": code,
                "sluice.endpoint": endpoint,
            }
            if trace.model is not None:
                attributes["gen_ai.request.model"] = trace.model
            if trace.backend is not None:
                attributes["sluice.backend"] = trace.backend
            server, children = request_spans(
                f"{method} {route}", context.timing, trace.ended, attributes
            )
            self.tracer.finish(span, server, children)
        if self.access_log is not None:
            # The seq the request log just gave it: the same record, the same number.
            self.access_log.write(trace.record(self.traffic.log.total))
