"""The OpenTelemetry SDK's side of tracing: turning finished requests into the SDK's spans and
handing them to its BatchSpanProcessor, whose own thread batches them and sends them over
OTLP/HTTP. Only tracing.py's worker thread calls in here, never the event loop; tracing.py
imports this module when tracing starts, so a proxy without `--otlp-endpoint` never loads the
SDK (~110 ms of imports).

Every span is counted once: `exported` or `failed` by the exporter's answer, or `overflow`
when the processor's queue has no room. The processor would make room by dropping its oldest
span, with a warning each time and no count we can read, so `hand_over` keeps what was handed
and not yet answered below the processor's capacity and drops (counting) itself instead.

A dead collector must cost nothing but a counter: the SDK logs a warning or an error for each
failed batch (every few seconds, for as long as the collector is down), so its exporter's
loggers are quietened and one line is logged when export starts failing and one when it
recovers.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Sequence

import requests
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from app.observe.spans import SpanRecord, TraceContext

log = logging.getLogger("sluice.tracing")

# Loggers that speak for every failed batch; ours speaks for a change of state.
QUIET_LOGGERS = (
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)
MAX_EXPORT_BATCH = 512  # the SDK's default batch
STATUS_ATTRIBUTE = "http.response.status_code"
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_ERROR = Status(StatusCode.ERROR)
_UNSET = Status(StatusCode.UNSET)


class HashedResource(Resource):
    """The SDK's Resource, its hash made once. The OTLP encoder groups a batch's spans by
    resource, hashing it once a span, and Resource hashes by writing its attributes as JSON
    (~6 µs here): the encoder took ~185 µs per request of 7 spans so, ~130 with the hash
    made once. The attributes are immutable (the SDK makes them so), and so is the hash."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


class CountingExporter(SpanExporter):
    """The OTLP exporter, counting spans by outcome (written by the processor's thread only,
    so plain integers suffice)."""

    def __init__(self, inner: SpanExporter, url: str) -> None:
        self._inner = inner
        self._url = url
        self.exported = 0
        self.failed = 0
        self._failing = False
        self._closed = False
        self._closing = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            if self._failing:
                self._failing = False
                log.warning("trace export to %s recovered", self._url)
        else:
            self.failed += len(spans)
            if not self._failing:
                self._failing = True
                log.warning(
                    "trace export to %s failed; spans are dropped and counted until it answers",
                    self._url,
                )
        return result

    @property
    def failing(self) -> bool:
        return self._failing

    def shutdown(self) -> None:
        # Called by the processor's shutdown and by `SpanPipeline.close`'s deadline, maybe
        # at once; the SDK's exporter warns on a second call.
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class SpanPipeline:
    """Builds the SDK's spans from what the loop handed over, and feeds the processor."""

    def __init__(self, url: str, service_name: str, capacity: int, export_timeout_s: float) -> None:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        session = requests.Session()
        session.trust_env = False  # like every client of ours: no proxy from the environment
        otlp = OTLPSpanExporter(endpoint=url, timeout=export_timeout_s, session=session)
        self.exporter = CountingExporter(otlp, url)
        self.capacity = capacity
        self.processor = BatchSpanProcessor(
            self.exporter,
            max_queue_size=capacity,
            max_export_batch_size=min(MAX_EXPORT_BATCH, capacity),
        )
        self.resource = HashedResource(Resource.create({SERVICE_NAME: service_name}))
        self.scope = InstrumentationScope("sluice")
        self.handed = 0
        self.overflow = 0
        # Children's span ids are made here, off the loop, as the SDK's RandomIdGenerator
        # makes them; only the server span's id is made on the loop (the engine needs it).
        self._random = random.Random()

    @property
    def outstanding(self) -> int:
        """Spans handed to the processor and not yet answered for: its queue and the batch
        being sent."""
        exporter = self.exporter
        return self.handed - exporter.exported - exporter.failed

    def hand_over(
        self, finished: Sequence[tuple[TraceContext, SpanRecord, Sequence[SpanRecord]]]
    ) -> None:
        """The handoff's consumer: each request's spans, all or none of them."""
        processor = self.processor
        for context, server, children in finished:
            if not context.sampled:
                continue  # the processor would drop it uncounted; the tracer never sends one
            count = 1 + len(children)
            if self.outstanding + count > self.capacity:
                self.overflow += count
                continue
            for span in self.build(context, server, children):
                processor.on_end(span)
            self.handed += count

    def build(
        self, context: TraceContext, server: SpanRecord, children: Sequence[SpanRecord]
    ) -> list[ReadableSpan]:
        """The server span (its parent the caller's span, when there was one) and its
        children, with the ids, times and attributes the loop recorded."""
        trace_id = int(context.trace_id, 16)
        flags = _SAMPLED if context.sampled else _NOT_SAMPLED
        own = SpanContext(trace_id, int(context.span_id, 16), False, flags)
        caller = (
            None
            if context.parent_id is None
            else SpanContext(trace_id, int(context.parent_id, 16), True, flags)
        )
        status = server.attributes.get(STATUS_ATTRIBUTE)
        # OpenTelemetry's HTTP conventions: a server span is an error on a 5xx only.
        failed = isinstance(status, int) and status >= 500
        spans = [
            ReadableSpan(
                server.name,
                own,
                caller,
                self.resource,
                server.attributes,
                kind=SpanKind.SERVER,
                status=_ERROR if failed else _UNSET,
                start_time=server.start_ns,
                end_time=server.end_ns,
                instrumentation_scope=self.scope,
            )
        ]
        for child in children:
            span_id = self._random.getrandbits(64) or 1
            spans.append(
                ReadableSpan(
                    child.name,
                    SpanContext(trace_id, span_id, False, flags),
                    own,
                    self.resource,
                    child.attributes,
                    kind=SpanKind.INTERNAL,
                    start_time=child.start_ns,
                    end_time=child.end_ns,
                    instrumentation_scope=self.scope,
                )
            )
        return spans

    def flush(self) -> None:
        """Send whatever the processor holds, now (blocking: the exporter's timeout bounds
        each try)."""
        self.processor.force_flush()

    def close(self, timeout_s: float) -> None:
        """Send what is queued within `timeout_s`, then stop (blocking). The processor's own
        shutdown waits up to 30 s for its thread; stopping the exporter ends that wait,
        since it ends the exporter's retries and closes its connections. Against a collector
        known to be down there is nothing to wait for, so it is stopped at once."""
        exporter = self.exporter
        if exporter.failing:
            exporter.shutdown()
        deadline = threading.Timer(timeout_s, exporter.shutdown)
        deadline.daemon = True
        deadline.start()
        try:
            self.processor.shutdown()  # type: ignore[no-untyped-call]
        finally:
            deadline.cancel()
