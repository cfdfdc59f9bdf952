"""Distributed tracing: W3C trace context in and out, and spans out over OTLP/HTTP.

Each request continues the caller's trace when its `traceparent` is valid (W3C Trace Context
Level 1) or starts one, and gets a span of Sluice's own, whose id goes to the engine in the
forwarded `traceparent` (`with_traceparent`), so the engine's spans hang under Sluice's:

    caller's span -> sluice (server span) -> queue, template, tokenize, route,
                                             upstream connect (a new connection only),
                                             first byte, relay
                                          -> the engine's spans

The loop's whole share, per request (~9 µs): `start_trace` (a regex match and one random
draw) and `Tracer.finish`, which appends plain data (`SpanRecord`s: names, times,
attributes) to a bounded queue, or drops and counts when it is full. A worker thread builds
the OpenTelemetry SDK's spans from it and hands them to the SDK's BatchSpanProcessor, whose
own thread sends them (span_export.py). Nothing is done per token, no I/O and no SDK object
on the loop, and a collector that is down or slow costs the counters in `counters()`. The
threads' work still holds the GIL (app/README.md has what it costs).

Times are Unix epoch nanoseconds, as OTLP carries them: `clock_offset_ns()` once per request
and `epoch_ns` turn the proxy's perf_counter readings into them without a wall-clock read
per phase.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import trio

from app.http.fields import Headers
from app.observe.handoff import Handoff
from app.observe.spans import Finished, SpanRecord, TraceContext

if TYPE_CHECKING:
    from app.observe.span_export import SpanPipeline

TRACES_PATH = "/v1/traces"
TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"
# version-traceid-parentid-flags, lower-case hex; a later version may append "-" and more.
_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.S)
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
# The SDK's queue holds spans, ours requests (up to eight spans each): the SDK's is made
# larger so that a collector's short pause is absorbed there, where it is seen, not by
# dropping whole requests at ours. ~1 KB a span: 8,192 spans by default.
SDK_SPANS_PER_QUEUED = 4
# How often the worker thread takes what the loop handed over. The SDK's processor sends
# every 5 s, so a second adds nothing a collector would see, and a wake is not free: ~90 µs
# of CPU and a turn of the GIL, with nothing to do: ten a second cost an idle traced proxy
# 0.9 ms/s (the thread's CPU from /proc over 45 s), and a busy one as much.
WAKE_INTERVAL_S = 1.0


def parse_traceparent(value: bytes | None) -> tuple[str, str, bool] | None:
    """(trace id, parent span id, sampled) of a valid `traceparent`, else None.

    W3C Trace Context Level 1, strictly: lower-case hex only, neither id all zeros, version
    ff refused. Version 00 is exactly 55 characters. A later version is read as far as 00
    defines it (the spec's forward compatibility): at least 55 characters, and after the
    flags either the end or a dash and whatever that version adds."""
    if value is None:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace, parent, flags, rest = match.groups()
    if version == b"ff" or (version == b"00" and rest is not None):
        return None
    trace_id, parent_id = trace.decode("ascii"), parent.decode("ascii")
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
    return trace_id, parent_id, int(flags, 16) & 1 == 1


def start_trace(header: bytes | None) -> TraceContext:
    """Continue the trace of a valid `traceparent`, or start a sampled one. The ids are
    drawn from `random`, as the OpenTelemetry SDK's RandomIdGenerator draws them (CPython
    reseeds it in a forked child): no system call, and a new trace takes both ids from one
    draw."""
    parsed = parse_traceparent(header)
    if parsed is None:
        ids = random.randbytes(24).hex()
        trace_id, span_id = ids[:32], ids[32:]
        if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
            return start_trace(None)  # one draw in 2**64
        return TraceContext(trace_id, None, span_id, True)
    trace_id, parent_id, sampled = parsed
    span_id = random.randbytes(8).hex()
    if span_id == _ZERO_SPAN:
        return start_trace(header)
    return TraceContext(trace_id, parent_id, span_id, sampled)


def with_traceparent(headers: Headers, context: TraceContext) -> Headers:
    """The headers to forward: the caller's traceparent replaced by Sluice's. Its
    tracestate goes on with a trace Sluice continues and not with one it started, since
    it belongs to a traceparent that was not valid (or not there)."""
    kept = [
        (name, value)
        for name, value in headers
        if name != TRACEPARENT and (name != TRACESTATE or context.parent_id is not None)
    ]
    kept.append((TRACEPARENT, context.upstream_traceparent()))
    return kept


def clock_offset_ns() -> int:
    """Unix epoch minus perf_counter, in nanoseconds: read once per request."""
    return time.time_ns() - time.perf_counter_ns()


def epoch_ns(perf: float, offset_ns: int) -> int:
    """A `time.perf_counter()` reading as Unix epoch nanoseconds."""
    return int(perf * 1e9) + offset_ns


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of `--otlp-endpoint`: a collector's base URL
    (http://host:4318, or with a path prefix) gets /v1/traces, a URL ending in it is kept.
    ValueError for anything but an http(s) URL with a host."""
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {endpoint!r}")
    path = parts.path.rstrip("/")
    if not path.endswith(TRACES_PATH):
        path += TRACES_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class Tracer:
    """Spans of finished requests, exported from threads: `finish` on the loop, `run` in a
    nursery. Without an endpoint it is disabled and `finish` does nothing."""

    def __init__(
        self,
        endpoint: str | None,
        *,
        service_name: str = "sluice",
        max_queued: int = 2048,
        export_timeout_s: float = 10.0,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        """`max_queued`: requests waiting for the worker thread (and four times as many
        spans waiting in the SDK's processor); past either, spans are dropped and counted.
        `export_timeout_s` bounds one batch's send with its retries; `shutdown_timeout_s`
        the last flush."""
        self.url = None if endpoint is None else traces_url(endpoint)
        self.enabled = self.url is not None
        self.service_name = service_name
        self.max_queued = max_queued
        self.max_sdk_spans = max_queued * SDK_SPANS_PER_QUEUED
        self._export_timeout_s = export_timeout_s
        self._shutdown_timeout_s = shutdown_timeout_s
        self._queue: Handoff[Finished] = Handoff(
            max_queued, name="sluice-tracing", interval_s=WAKE_INTERVAL_S
        )
        self._dropped = 0  # spans refused at the queue (the loop writes it)
        self._pipeline: SpanPipeline | None = None

    def finish(
        self, context: TraceContext, server_span: SpanRecord, children: Sequence[SpanRecord]
    ) -> None:
        """Hand a finished request's spans over (on the loop: O(1), no I/O). An unsampled
        trace is not exported: its caller asked for that."""
        if not (self.enabled and context.sampled):
            return
        if not self._queue.offer((context, server_span, children)):
            self._dropped += 1 + len(children)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Export until cancelled, then flush what is left (bounded by the shutdown
        timeout). Disabled, it returns at once."""
        url = self.url
        if url is None:
            task_status.started()
            return
        self._pipeline = pipeline = await trio.to_thread.run_sync(self._open_pipeline, url)
        await self._queue.run(
            pipeline.hand_over,
            close=pipeline.close,
            timeout_s=self._shutdown_timeout_s,
            task_status=task_status,
        )

    def _open_pipeline(self, url: str) -> SpanPipeline:
        # Imported here, in a thread: the SDK's imports take ~110 ms, paid only with tracing.
        from app.observe.span_export import SpanPipeline

        return SpanPipeline(url, self.service_name, self.max_sdk_spans, self._export_timeout_s)

    async def flush(self) -> None:
        """Send everything finished so far, now, and return once the collector answered or
        the export failed (for tests and shutdowns; runs in a thread)."""
        pipeline = self._pipeline
        if pipeline is not None:
            await trio.to_thread.run_sync(self._flush, pipeline)

    def _flush(self, pipeline: SpanPipeline) -> None:
        self._queue.drain(pipeline.hand_over)
        pipeline.flush()

    def counters(self) -> dict[str, int]:
        """Spans exported, dropped (a queue was full) and failed (the collector refused them
        or could not be reached), since start: counters for Prometheus and the dashboard."""
        pipeline = self._pipeline
        if pipeline is None:
            return {"exported": 0, "dropped": self._dropped, "failed": 0}
        return {
            "exported": pipeline.exporter.exported,
            "dropped": self._dropped + pipeline.overflow,
            "failed": pipeline.exporter.failed,
        }

    def pending(self) -> tuple[int, int]:
        """(requests waiting for the worker thread, spans waiting in the SDK's processor):
        at most `max_queued` and `max_sdk_spans`."""
        pipeline = self._pipeline
        return len(self._queue), 0 if pipeline is None else pipeline.outstanding

    @property
    def exporting(self) -> bool:
        """The worker thread is running."""
        return self._queue.alive
