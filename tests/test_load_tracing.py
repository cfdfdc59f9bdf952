"""`bench tracing` without its processes: the collector sink (load/otlp_sink.py) counts the
posts, spans and requests that Sluice's tracer exports to it, as Sluice counts them, and
answers anything but POST /v1/traces with 404; the table pools each kind of pair (control,
traced) over its rounds, weighing each round by its tokens, and holds the traced pair's ratio
against issue 33's target; a Sluice's helper threads' CPU counts from the window's start, or
from a thread's own start within it; `--streams` takes a whole number of 1 or more."""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import pytest
import trio

from app.observe.spans import SpanRecord
from app.observe.tracing import Tracer, start_trace
from load import otlp_sink
from load.bench import tracing
from load.processes import threads_cpu_since


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


def side(cpu: float, helpers: float, tokens: int = 1000) -> dict[str, float]:
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / 10,
        "cpu_ms_per_1000_tokens": cpu,
        "helper_threads_ms_per_1000_tokens": helpers,
        "errors": 0,
    }


def test_the_table_pools_each_kind_of_pair_over_its_rounds() -> None:
    def pair(number: int, kind: str, first: float, second: float, tokens: int) -> dict[str, Any]:
        return {
            "round": number,
            "kind": kind,
            "first": side(first, 0.1, tokens),
            "second": side(second, 1.5 if kind == "traced" else 0.1, tokens),
            "ratio": second / first,
            "dropped": 0.0,
            "failed": 0.0,
        }

    result: dict[str, Any] = {
        "streams": 50,
        "tokens_per_stream": 200,
        "inter_token_s": 0.02,
        "rounds": 2,
        "seconds_per_round": 10.0,
        "pairs": [
            pair(1, "control", 40.0, 40.4, 1000),
            pair(1, "traced", 40.0, 41.2, 1000),
            pair(2, "traced", 50.0, 52.0, 3000),
            pair(2, "control", 50.0, 49.5, 3000),
        ],
        "sink": {"posts": 3, "spans": 700, "requests": 100},
    }
    table = tracing.tables(result)[0]
    by_kind = {row[0]: row for row in table.rows}
    # Pooled: each side's CPU over all its tokens (round 2 weighs three times round 1).
    assert round(by_kind["traced"][3], 3) == 47.5 and round(by_kind["traced"][4], 3) == 49.3
    assert round(by_kind["traced"][5], 4) == round(49.3 / 47.5, 4)
    assert by_kind["traced"][6] == "+3.5 (+3.0 to +4.0)"
    assert (by_kind["traced"][10], by_kind["control"][10]) == (True, None)
    assert round(by_kind["traced"][8], 3) == 1.5
    assert "0 dropped, 0 failed" in table.title
    assert "700 spans of 100 requests in 3 POSTs" in table.title


def test_a_traced_pair_over_the_target_is_not_met() -> None:
    traced = {"round": 1, "kind": "traced", "first": side(40.0, 0.0), "second": side(42.4, 1.0),
              "ratio": 1.06, "dropped": 0.0, "failed": 0.0}  # fmt: skip
    result: dict[str, Any] = {
        "streams": 50, "tokens_per_stream": 200, "inter_token_s": 0.02, "rounds": 1,
        "seconds_per_round": 10.0, "pairs": [traced],
        "sink": {"posts": 1, "spans": 6, "requests": 1},
    }  # fmt: skip
    (row,) = tracing.tables(result)[0].rows
    assert row[0] == "traced" and row[10] is False


def test_helper_threads_count_from_the_window_start_or_from_their_own() -> None:
    before = {11: 2.0, 12: 5.0}  # 12 ends within the window
    now = {11: 2.5, 13: 0.25}  # 13 starts within it
    assert threads_cpu_since(before, now) == 0.75


@pytest.mark.parametrize("given", ["0", "-3", "x", "2.5"])
def test_the_streams_a_side_are_a_whole_number_of_one_or_more(given: str) -> None:
    parser = argparse.ArgumentParser()
    tracing.options(parser)
    assert parser.parse_args([]).streams == tracing.STREAMS
    assert parser.parse_args(["--streams", "3"]).streams == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--streams", given])
