"""Tracing (app/observe/tracing.py, span_export.py, handoff.py).

Covers: `parse_traceparent` against W3C Trace Context Level 1 (a valid header and the
sampled flag; each invalid form: wrong length, separators, upper-case or non-hex digits,
all-zero ids, version ff, anything after a version-00 header; later versions read as far as
00 defines them); `start_trace` continuing a valid header or starting a sampled trace; the
traceparent the engine gets and the headers forwarded with it; the collector's URL in both
forms; perf_counter readings as epoch nanoseconds; a request's phases as spans
(proxy/request_spans.py), `upstream.connect` only where a connection was opened. Then,
against an OTLP/HTTP collector that the test serves on 127.0.0.1: a finished request's spans
arrive with the trace id, the server span under the caller's span and the phases under the
server span, their names, times, kinds and attributes, and service.name. A full queue drops
and counts; an unsampled trace is not sent; a collector on a closed port counts failures
(one log line, nothing from the SDK) with the queues bounded, and nothing grows from round
to round; a collector that accepts and never answers leaves the loop free, drops and counts
past the bounds, and does not hold shutdown. The resource the spans carry hashes (once) as
the SDK's own would."""

from __future__ import annotations

import logging
import socket
import time

import pytest
import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.resources import Resource

from app.http.exchange import Exchange
from app.http.server import HttpServer
from app.observe.request_spans import request_spans
from app.observe.span_export import HashedResource
from app.observe.spans import SpanRecord, TraceContext
from app.observe.tracing import (
    Tracer,
    clock_offset_ns,
    epoch_ns,
    parse_traceparent,
    start_trace,
    traces_url,
    with_traceparent,
)
from app.proxy.to_backend import Timing

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{PARENT}-01".encode()
PHASES = ("queue", "template", "tokenize", "route", "upstream connect", "first byte", "relay")


# --- parse_traceparent -----------------------------------------------------------------


def test_a_valid_traceparent_gives_its_ids_and_sampled_flag() -> None:
    assert parse_traceparent(VALID) == (TRACE, PARENT, True)
    assert parse_traceparent(VALID[:-2] + b"00") == (TRACE, PARENT, False)
    # Only bit 0 is the sampled flag; the others are not ours to judge.
    assert parse_traceparent(VALID[:-2] + b"03") == (TRACE, PARENT, True)
    assert parse_traceparent(VALID[:-2] + b"fe") == (TRACE, PARENT, False)


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"",
        VALID[:-1],  # too short
        VALID + b"0",  # too long for version 00
        VALID + b"-extra",  # version 00 has nothing after its flags
        VALID.replace(b"-", b"_"),
        VALID.replace(b"-", b"", 1),
        b" " + VALID[:-1],
        f"00-{TRACE.upper()}-{PARENT}-01".encode(),  # upper-case hex is refused
        f"00-{TRACE}-{PARENT.upper()}-01".encode(),
        f"00-{TRACE}-{PARENT}-0A".encode(),
        f"0A-{TRACE}-{PARENT}-01".encode(),
        f"00-{TRACE[:-1]}g-{PARENT}-01".encode(),
        f"00-{TRACE[:-1]}-{PARENT}0-01".encode(),  # a dash one place early
        f"00-{'0' * 32}-{PARENT}-01".encode(),  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01".encode(),  # all-zero parent id
        f"ff-{TRACE}-{PARENT}-01".encode(),  # version ff is forbidden
        f"ff-{TRACE}-{PARENT}-01-more".encode(),
        f"00-{TRACE}-{PARENT}-1".encode(),
        f"00-{TRACE}-{PARENT}-".encode(),
    ],
)
def test_each_invalid_traceparent_is_refused(value: bytes | None) -> None:
    assert parse_traceparent(value) is None


def test_a_later_version_is_read_as_far_as_version_00_defines() -> None:
    assert parse_traceparent(f"01-{TRACE}-{PARENT}-01".encode()) == (TRACE, PARENT, True)
    assert parse_traceparent(f"cc-{TRACE}-{PARENT}-00-anything".encode()) == (
        TRACE,
        PARENT,
        False,
    )
    # After the flags: the end or a dash, nothing else; and never shorter than 00's.
    assert parse_traceparent(f"cc-{TRACE}-{PARENT}-01x".encode()) is None
    assert parse_traceparent(f"cc-{TRACE}-{PARENT}-1".encode()) is None
    assert parse_traceparent(f"cc-{'0' * 32}-{PARENT}-01-x".encode()) is None


# --- start_trace and what is forwarded -------------------------------------------------


def test_start_trace_continues_a_valid_traceparent() -> None:
    context = start_trace(VALID)
    assert (context.trace_id, context.parent_id, context.sampled) == (TRACE, PARENT, True)
    assert len(context.span_id) == 16 and int(context.span_id, 16) != 0
    assert context.span_id != PARENT
    assert context.upstream_traceparent() == f"00-{TRACE}-{context.span_id}-01".encode()
    unsampled = start_trace(VALID[:-2] + b"00")
    assert not unsampled.sampled
    assert unsampled.upstream_traceparent().endswith(b"-00")


@pytest.mark.parametrize("header", [None, b"", b"garbage", f"ff-{TRACE}-{PARENT}-01".encode()])
def test_start_trace_starts_a_sampled_trace_without_a_valid_one(header: bytes | None) -> None:
    contexts = [start_trace(header) for _ in range(50)]
    for context in contexts:
        assert context.parent_id is None and context.sampled
        assert parse_traceparent(context.upstream_traceparent()) == (
            context.trace_id,
            context.span_id,
            True,
        )
    assert len({c.trace_id for c in contexts}) == len({c.span_id for c in contexts}) == 50


def test_the_engine_gets_sluices_traceparent_and_tracestate_only_with_a_continued_trace() -> None:
    headers = [
        (b"traceparent", VALID),
        (b"tracestate", b"vendor=x"),
        (b"x-request-id", b"r1"),
        (b"traceparent", b"a second one"),
    ]
    continued = start_trace(VALID)
    forwarded = with_traceparent(headers, continued)
    assert forwarded == [
        (b"tracestate", b"vendor=x"),
        (b"x-request-id", b"r1"),
        (b"traceparent", continued.upstream_traceparent()),
    ]
    started = start_trace(b"garbage")
    assert with_traceparent(headers, started) == [
        (b"x-request-id", b"r1"),
        (b"traceparent", started.upstream_traceparent()),
    ]


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
        ("http://127.0.0.1:4318/", "http://127.0.0.1:4318/v1/traces"),
        ("https://otel.example:443/otlp", "https://otel.example:443/otlp/v1/traces"),
        ("http://127.0.0.1:4318/v1/traces", "http://127.0.0.1:4318/v1/traces"),
        ("http://127.0.0.1:4318/v1/traces/", "http://127.0.0.1:4318/v1/traces"),
    ],
)
def test_the_collector_url_is_taken_as_base_or_whole(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4318", "grpc://127.0.0.1:4317", "http://"])
def test_a_collector_url_that_is_not_http_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError):
        traces_url(endpoint)


def test_perf_counter_readings_become_epoch_nanoseconds() -> None:
    before = time.time_ns()
    offset = clock_offset_ns()
    reading = time.perf_counter()
    after = time.time_ns()
    # The offset is read from two clocks a moment apart: allow it a millisecond.
    assert before - 1_000_000 <= epoch_ns(reading, offset) <= after + 1_000_000


# --- the tracer against a collector ----------------------------------------------------


class Collector:
    """An OTLP/HTTP collector: each export request decoded, with the path it came to."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, ExportTraceServiceRequest]] = []

    async def __call__(self, exchange: Exchange) -> None:
        body = await exchange.read_body(1 << 24)
        self.requests.append((exchange.path, ExportTraceServiceRequest.FromString(body)))
        answer = ExportTraceServiceResponse().SerializeToString()
        await exchange.respond(200, [(b"content-type", b"application/x-protobuf")], answer)

    def spans(self) -> list[tuple[dict[str, object], Span]]:
        """Every span received, with its resource's attributes."""
        found = []
        for _, request in self.requests:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    found.extend((resource, span) for span in scope_spans.spans)
        return found


def a_request(context: TraceContext, status: int = 200) -> tuple[SpanRecord, list[SpanRecord]]:
    """A finished request's server span and its phases, one after another."""
    offset = clock_offset_ns()
    start = epoch_ns(time.perf_counter(), offset)
    children = [
        SpanRecord(name, start + i * 1000, start + (i + 1) * 1000, {"phase": i})
        for i, name in enumerate(PHASES)
    ]
    attributes: dict[str, str | int | float | bool] = {
        "http.response.status_code": status,
        "sluice.backend": "http://127.0.0.1:9",
        "sluice.stream": True,
    }
    server = SpanRecord("POST /v1/chat/completions", start, start + 8000, attributes)
    return server, children


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_the_collector_gets_a_requests_spans_under_the_right_parents(
    nursery: trio.Nursery,
) -> None:
    collector = Collector()
    url = await nursery.start(HttpServer(collector).serve, "127.0.0.1", 0, 16)
    tracer = Tracer(url, service_name="sluice-test")
    await nursery.start(tracer.run)
    assert tracer.exporting

    continued = start_trace(VALID)
    server, children = a_request(continued)
    tracer.finish(continued, server, children)
    started = start_trace(None)
    failed_server, _ = a_request(started, status=503)
    tracer.finish(started, failed_server, [])
    await tracer.flush()

    assert {path for path, _ in collector.requests} == {"/v1/traces"}
    spans = collector.spans()
    assert len(spans) == 1 + len(PHASES) + 1
    assert {resource["service.name"] for resource, _ in spans} == {"sluice-test"}
    by_trace: dict[bytes, list[Span]] = {}
    for _, span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)

    first = {span.name: span for span in by_trace[bytes.fromhex(TRACE)]}
    root = first.pop(server.name)
    assert root.span_id == bytes.fromhex(continued.span_id)
    assert root.parent_span_id == bytes.fromhex(PARENT)
    assert root.kind == Span.SPAN_KIND_SERVER
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (server.start_ns, server.end_ns)
    assert {a.key for a in root.attributes} == set(server.attributes)
    assert root.status.code == Status.STATUS_CODE_UNSET
    assert list(first) == list(PHASES)
    for child, record in zip(first.values(), children, strict=True):
        assert child.parent_span_id == root.span_id
        assert child.kind == Span.SPAN_KIND_INTERNAL
        assert (child.start_time_unix_nano, child.end_time_unix_nano) == (
            record.start_ns,
            record.end_ns,
        )
        assert [(a.key, a.value.int_value) for a in child.attributes] == list(
            record.attributes.items()
        )
    ids = {root.span_id, *(child.span_id for child in first.values())}
    assert len(ids) == 1 + len(PHASES) and bytes(8) not in ids

    (second,) = by_trace[bytes.fromhex(started.trace_id)]
    assert second.span_id == bytes.fromhex(started.span_id)
    assert second.parent_span_id == b""  # a trace Sluice started has no parent
    assert second.status.code == Status.STATUS_CODE_ERROR  # a 5xx
    assert tracer.counters() == {"exported": 2 + len(PHASES), "dropped": 0, "failed": 0}


async def test_a_full_queue_drops_and_counts_and_an_unsampled_trace_is_not_sent() -> None:
    tracer = Tracer("http://127.0.0.1:9", max_queued=4)  # never run: nothing drains it
    context = start_trace(None)
    server, children = a_request(context)
    for _ in range(10):
        tracer.finish(context, server, children)
    tracer.finish(start_trace(VALID[:-2] + b"00"), server, children)
    assert tracer.pending() == (4, 0)
    assert tracer.counters() == {"exported": 0, "dropped": 6 * (1 + len(PHASES)), "failed": 0}

    disabled = Tracer(None)
    disabled.finish(context, server, children)
    await disabled.run()  # returns at once
    assert not disabled.enabled and disabled.pending() == (0, 0)


def finish_a_request(tracer: Tracer, children: int) -> None:
    """A new trace's server span and the first `children` of its child spans, finished."""
    context = start_trace(None)
    server, spans = a_request(context)
    tracer.finish(context, server, spans[:children])


async def test_a_dead_collector_costs_a_counter_and_nothing_grows(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    tracer = Tracer(closed_port_url(), max_queued=64, export_timeout_s=0.5)
    await nursery.start(tracer.run)
    offered = 0
    for _ in range(3):
        for _ in range(1000):
            finish_a_request(tracer, children=3)
            offered += 4
            waiting, in_sdk = tracer.pending()
            assert waiting <= 64 and in_sdk <= tracer.max_sdk_spans
        await tracer.flush()
        counts = tracer.counters()
        assert counts["exported"] == 0 and counts["failed"] > 0
        # Every span is accounted for, and nothing waits once flushed.
        assert counts["failed"] + counts["dropped"] == offered
        assert tracer.pending() == (0, 0)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")] == []
    failing = [r for r in caplog.records if r.name == "sluice.tracing"]
    assert len(failing) == 1 and "failed" in failing[0].getMessage()


async def test_a_silent_collector_holds_neither_the_loop_nor_shutdown() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepted by the kernel, never answered
    port = listener.getsockname()[1]
    tracer = Tracer(
        f"http://127.0.0.1:{port}", max_queued=8, export_timeout_s=0.5, shutdown_timeout_s=0.1
    )
    offered = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(tracer.run)
        for _ in range(400):
            finish_a_request(tracer, children=1)
            offered += 2
            waiting, in_sdk = tracer.pending()
            assert waiting <= 8 and in_sdk <= tracer.max_sdk_spans
            await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    listener.close()
    assert not tracer.exporting
    counts = tracer.counters()
    assert counts["exported"] == 0
    # At most one queue's worth of requests and the SDK's worth of spans were not dropped.
    assert counts["dropped"] >= offered - 8 * 2 - tracer.max_sdk_spans


def test_the_resource_hashes_as_the_sdks_own() -> None:
    resource = Resource.create({"service.name": "sluice-test"})
    hashed = HashedResource(resource)
    assert hashed == resource and hash(hashed) == hash(resource)
    assert dict(hashed.attributes) == dict(resource.attributes)
    grouped: dict[Resource, int] = {hashed: 1}
    assert grouped[resource] == 1  # the encoder's grouping finds one resource


@pytest.mark.parametrize("connected", [True, False], ids=["new connection", "kept alive"])
def test_a_requests_phases_as_spans_laid_end_to_end(connected: bool) -> None:
    timing = Timing(started=10.0, template=0.5, tokenize=0.25, queue=1.0)
    timing.read_at, timing.routing_at, timing.routed_at = 10.5, 11.5, 13.0
    timing.sent_at, timing.answered_at, timing.connected = 13.5, 14.0, connected
    server, children = request_spans("POST /v1/chat/completions", timing, 20.0, {"k": 1})

    def at(ns: int) -> float:
        """Seconds after the request's first byte (10.0 on the perf_counter above)."""
        return 10.0 + round((ns - server.start_ns) / 1e9, 6)

    assert (at(server.end_ns), server.attributes) == (20.0, {"k": 1})
    spans = {child.name: (at(child.start_ns), at(child.end_ns)) for child in children}
    upstream = {"upstream.connect": (13.0, 13.5)} if connected else {}
    assert spans == {
        "template": (10.5, 11.0),
        "tokenize": (11.0, 11.25),
        "queue": (11.5, 12.5),
        "route": (12.5, 13.0),
        **upstream,
        # On a kept-alive connection, sending is part of waiting for the first byte.
        "upstream.first_byte": (13.5 if connected else 13.0, 14.0),
        "relay": (14.0, 20.0),
    }


def test_a_request_served_in_two_hops_has_a_span_per_leg() -> None:
    timing = Timing(started=10.0)
    timing.routing_at, timing.routed_at = 10.5, 11.0
    timing.prefill_at, timing.prefilled_at = 11.0, 12.0  # the prefill leg, read whole
    timing.sent_at, timing.answered_at = 12.25, 12.5  # then the decode leg
    _, children = request_spans("POST /v1/chat/completions", timing, 20.0, {})
    legs = {
        child.name: round((child.end_ns - child.start_ns) / 1e9, 6)
        for child in children
        if child.name in ("prefill", "decode")
    }
    assert legs == {"prefill": 1.0, "decode": 7.75}
