"""A finished request's spans, from the marks its `Timing` kept. Pure.

Made once per request, after its answer ended, and only with `--otlp-endpoint`: the server
span covers the request from its first byte to its last; its children are the phases, each
laid where it happened (`upstream.connect` only where a connection was opened; `prefill` and
`decode` for a request served in two hops). Template and
tokenize are measured as durations (a render or a tokenization may run in a worker), so they
are laid end to end from the moment the body was read. A phase the request never reached
(refused before routing, a backend that never answered) has no span.
"""

from __future__ import annotations

from app.observe.spans import Attributes, SpanRecord
from app.observe.timing import Timing
from app.observe.tracing import clock_offset_ns, epoch_ns


def request_spans(
    name: str, timing: Timing, ended: float, attributes: Attributes
) -> tuple[SpanRecord, list[SpanRecord]]:
    """(the server span, its children) of a request whose last byte left at `ended`; the
    server span is `name`d as OpenTelemetry's HTTP conventions say: method and route."""
    offset = clock_offset_ns()

    def span(name: str, start: float, end: float) -> SpanRecord:
        return SpanRecord(name, epoch_ns(start, offset), epoch_ns(end, offset), {})

    server = SpanRecord(name, epoch_ns(timing.started, offset), epoch_ns(ended, offset), attributes)
    children: list[SpanRecord] = []
    if timing.read_at:
        template_end = timing.read_at + timing.template
        if timing.template:
            children.append(span("template", timing.read_at, template_end))
        if timing.tokenize:
            children.append(span("tokenize", template_end, template_end + timing.tokenize))
    if timing.routing_at and timing.routed_at:
        held_until = timing.routing_at + timing.queue
        if timing.queue:
            children.append(span("queue", timing.routing_at, held_until))
        children.append(span("route", held_until, timing.routed_at))
    if timing.prefill_at and timing.prefilled_at:
        children.append(span("prefill", timing.prefill_at, timing.prefilled_at))
        if timing.sent_at:
            children.append(span("decode", timing.sent_at, ended))
    if timing.routed_at and timing.sent_at:
        # On a kept-alive connection nothing was connected: sending the request is then part
        # of waiting for the first byte. (A span costs the exporter's thread ~20 µs.)
        if timing.connected:
            children.append(span("upstream.connect", timing.routed_at, timing.sent_at))
        if timing.answered_at:
            asked_at = timing.sent_at if timing.connected else timing.routed_at
            children.append(span("upstream.first_byte", asked_at, timing.answered_at))
            children.append(span("relay", timing.answered_at, ended))
    return server, children
