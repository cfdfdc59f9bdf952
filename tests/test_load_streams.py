"""`bench streams --traced` without its rounds: the collector sink (load/otlp_sink.py) counts
the posts, spans and requests that Sluice's tracer exports to it, as Sluice counts them, and
answers anything but POST /v1/traces with 404; the tracing table gives sluice+otlp's CPU per
1,000 tokens over sluice's against issue 33's target, and the spans counted."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from app.observe.spans import SpanRecord
from app.observe.tracing import Tracer, start_trace
from load import otlp_sink
from load.bench import streams


async def test_the_sink_counts_what_the_tracer_exported() -> None:
    async with otlp_sink.serving() as sink, trio.open_nursery() as nursery:
        tracer = Tracer(sink.url)
        await nursery.start(tracer.run)
        for children in (0, 3):
            context = start_trace(None)
            server = SpanRecord("POST /v1/chat/completions", 1, 9, {"sluice.stream": True})
            tracer.finish(context, server, [SpanRecord("relay", 2, 8, {})] * children)
        await tracer.flush()
        async with httpx.AsyncClient(trust_env=False) as client:
            assert (await client.get(sink.url + "/v1/traces")).status_code == 404
        nursery.cancel_scope.cancel()
    assert sink.posts >= 1 and (sink.spans, sink.requests) == (5, 2)
    assert tracer.counters() == {"exported": 5, "dropped": 0, "failed": 0}


def test_the_tracing_table_compares_the_traced_sluice_with_the_plain_one() -> None:
    def target(cpu: float) -> dict[str, float]:
        return {"cpu_ms_per_1000_tokens": cpu}

    result: dict[str, Any] = {
        "streams": {
            "50": {"sluice": target(40.0), "sluice+otlp": target(41.0)},
            "200": {"sluice": target(30.0), "sluice+otlp": target(33.0)},
        },
        "tracing": {
            "cpu_change_pct": {"50": [2.5, 1.0, 4.0], "200": [10.0, 8.0, 12.0]},
            "spans": {"exported": 700.0, "dropped": 0.0, "failed": 0.0},
            "sink": {"posts": 3, "spans": 700, "requests": 100},
        },
    }
    table = streams.tracing_table(result, result["tracing"])
    assert [(row[0], round(row[3], 3), row[5]) for row in table.rows] == [
        ("50", 1.025, True),
        ("200", 1.1, False),
    ]
    assert "700 exported, 0 dropped, 0 failed" in table.title
    assert "700 spans of 100 requests in 3 POSTs" in table.title
