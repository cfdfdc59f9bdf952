"""A disaggregated model's row in the dashboard's snapshot, alone: its `disaggregation` block
(each role's pool summarised as a model's pool is, its requests by how they were served, read
back from the proxy's own `sluice_pd_*` counters, its prefill legs' times from the request
log), no such block for a model without roles, the block against the served schema, and two
workers' blocks merged as the supervisor merges them."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from app.dashboard.model_rows import model_rows
from app.dashboard.worker_snapshots import merge_snapshots
from app.models import ModelDirectory
from app.observe.metric_summaries import counts_by_label, counts_by_two_labels
from app.proxy.metrics import PdMetrics
from tests.test_dashboard_schema import SCHEMA, mismatches


def engine(running: int, kv: float | None) -> dict[str, Any]:
    return {
        "name": "vllm",
        "running": running,
        "waiting": 2,
        "kv_cache_usage": kv,
        "prefix_cache_hit_rate": None,
    }


def backend(id_: str, role: str, serves: list[str], **fields: Any) -> dict[str, Any]:
    return {
        "id": id_,
        "role": role,
        "serves": serves,
        "healthy": True,
        "breakers": {},
        "inflight": 1,
        "engine": engine(1, 0.25),
        "draining_for": None,
        **fields,
    }


BACKENDS = [
    backend("p1", "prefill", ["big"], engine=engine(3, 0.5)),
    backend("p2", "prefill", ["big"], healthy=False, engine=None),
    backend("d1", "decode", ["big"], inflight=4, engine=engine(7, 0.75)),
    backend("w", "both", ["big", "small"]),
    backend("s", "both", ["small"]),
]
RECENT = [
    {"model": "big", "ttft_ms": 40.0, "legs": {"prefill_ms": 30.0}},
    {"model": "big", "ttft_ms": 20.0, "legs": {"prefill_ms": 10.0}},
    {"model": "big", "ttft_ms": 5.0, "legs": {"prefill_ms": None}},  # one hop
    {"model": "small", "ttft_ms": 5.0},
]


def counted() -> PdMetrics:
    """The proxy's counters after 5 requests of `big` in two hops and 4 in one, 1 leg lost."""
    pd = PdMetrics(CollectorRegistry())
    pd.requests.labels(model="big", mode="disaggregated", reason="disaggregated").inc(5)
    pd.requests.labels(model="big", mode="aggregated", reason="short").inc(3)
    pd.requests.labels(model="big", mode="aggregated", reason="no transfer").inc()
    pd.leg_failures.labels(leg="prefill").inc()
    return pd


def rows(
    pd: PdMetrics, backends: list[dict[str, Any]] = BACKENDS, recent: list[dict[str, Any]] = RECENT
) -> list[Any]:
    directory = ModelDirectory(frozenset({"big", "small"}), {}, {})
    described = {"tokenizer": "words", "chat_template": "chatml"}
    return model_rows(
        directory,
        backends,
        {},
        described,
        {},
        {},
        recent,
        counts_by_two_labels(pd.requests, "model", "reason"),
        counts_by_label(pd.leg_failures, "leg"),
    )


def test_a_disaggregated_model_has_each_roles_pool_and_its_requests_by_way() -> None:
    big, small = rows(counted())
    block = big["disaggregation"]
    assert list(block["pools"]) == ["prefill", "decode", "both"]
    prefill, decode, both = (block["pools"][role] for role in ("prefill", "decode", "both"))
    assert (prefill["backends"], prefill["serving_backends"], prefill["inflight"]) == (
        ["p1", "p2"],
        1,
        2,
    )
    assert (prefill["engine_running"], prefill["engine_kv_cache_usage"]) == (3, 0.5)
    assert (decode["backends"], decode["inflight"], decode["engine_running"]) == (["d1"], 4, 7)
    assert (decode["engine_waiting"], decode["engine_kv_cache_usage"]) == (2, 0.75)
    assert both["backends"] == ["w"]
    assert block["two_hops"] == 5
    assert block["one_hop"] == {"short": 3, "no transfer": 1}
    assert block["leg_failures"] == {"prefill": 1}
    assert (block["prefill_p50_ms"], block["prefill_p99_ms"]) == (20.0, pytest.approx(29.8))
    # The whole pool is summarised as before: every role's engines together.
    assert big["pool"]["backends"] == ["p1", "p2", "d1", "w"]
    assert "disaggregation" not in small


def test_a_pool_without_both_engines_and_without_requests_yet() -> None:
    roles_only = [b for b in BACKENDS if b["role"] != "both"]
    big = rows(PdMetrics(CollectorRegistry()), roles_only, [])[0]
    block = big["disaggregation"]
    assert list(block["pools"]) == ["prefill", "decode"]
    assert (block["two_hops"], block["one_hop"], block["leg_failures"]) == (0, {}, {})
    assert block["prefill_p50_ms"] is None


def test_the_block_is_in_the_schema_and_two_workers_blocks_merge() -> None:
    big = rows(counted())[0]
    model_schema = {"$ref": "#/$defs/ModelRow"}
    assert mismatches(big, model_schema) == []
    merged = merge_snapshots([{"models": [big]}, {"models": [big]}])  # type: ignore[list-item]
    block = merged["models"][0]["disaggregation"]
    assert (block["two_hops"], block["one_hop"]["short"], block["leg_failures"]) == (
        10,
        6,
        {"prefill": 2},
    )
    decode = block["pools"]["decode"]
    # Each worker's own requests in flight add up; what the engines report is seen alike.
    assert (decode["inflight"], decode["engine_running"], decode["serving_backends"]) == (8, 7, 1)
    assert block["prefill_p50_ms"] == 20.0
    assert SCHEMA["$defs"]["ModelDisaggregation"]["description"]
