"""A traced request as the loop records it: its trace context and its spans, plain data that
tracing.py hands to a worker thread and span_export.py makes into the OpenTelemetry SDK's
spans there."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Attributes = dict[str, str | int | float | bool]


@dataclass(slots=True)
class TraceContext:
    trace_id: str  # 32 lower-case hex digits
    parent_id: str | None  # the caller's span id from its traceparent; None: a new trace
    span_id: str  # Sluice's server span for this request (16 hex, random)
    sampled: bool  # the traceparent's flag; a trace Sluice starts is sampled

    def upstream_traceparent(self) -> bytes:
        """The traceparent the engine gets: this trace, Sluice's span as its parent."""
        flags = "01" if self.sampled else "00"
        return f"00-{self.trace_id}-{self.span_id}-{flags}".encode("ascii")


@dataclass(slots=True)
class SpanRecord:
    """A span as the loop records it: plain data, made into the SDK's span off the loop.
    Its attributes must not change once handed to `Tracer.finish`."""

    name: str
    start_ns: int  # Unix epoch nanoseconds
    end_ns: int
    attributes: Attributes


Finished = tuple[TraceContext, SpanRecord, Sequence[SpanRecord]]
