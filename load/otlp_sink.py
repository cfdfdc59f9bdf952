"""An OTLP/HTTP trace collector that keeps nothing but counts, for `bench tracing`:
POST /v1/traces answered 200 with an empty ExportTraceServiceResponse (which encodes to no
bytes), each body decoded so that the bench can say how many spans, and of how many
requests, actually arrived. It runs on Sluice's own HTTP server inside the bench process: its
CPU is not the proxy's, and the proxy's exporter only needs a prompt 200.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from app.http.exchange import Exchange
from app.http.server import HttpServer
from app.observe.tracing import TRACES_PATH

# One batch of the SDK's (512 spans of ~1 KB at most) and room to spare.
MAX_BODY_BYTES = 64 << 20
PROTOBUF = [(b"content-type", b"application/x-protobuf")]


class OtlpSink:
    """Counts of what the collector received; `url` once `serving` has started it."""

    def __init__(self) -> None:
        self.url = ""
        self.posts = 0
        self.spans = 0
        self.requests = 0  # server spans: Sluice makes one per traced request

    async def __call__(self, exchange: Exchange) -> None:
        if exchange.method != "POST" or exchange.path != TRACES_PATH:
            await exchange.respond(404, [], b"")
            return
        self.count(ExportTraceServiceRequest.FromString(await exchange.read_body(MAX_BODY_BYTES)))
        await exchange.respond(200, PROTOBUF, b"")

    def count(self, export: ExportTraceServiceRequest) -> None:
        self.posts += 1
        for resource_spans in export.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans += 1
                    self.requests += span.kind == Span.SPAN_KIND_SERVER

    def counts(self) -> dict[str, int]:
        return {"posts": self.posts, "spans": self.spans, "requests": self.requests}


@asynccontextmanager
async def serving() -> AsyncIterator[OtlpSink]:
    """A sink listening on 127.0.0.1 (a free port) for as long as the block runs."""
    sink = OtlpSink()
    async with trio.open_nursery() as nursery:
        sink.url = await nursery.start(HttpServer(sink).serve, "127.0.0.1", 0, 64)
        yield sink
        nursery.cancel_scope.cancel()
