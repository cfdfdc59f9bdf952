"""The dashboard's pure pieces, alone: time series (CounterWindow, Columns), the request log,
per-backend stats, each model's pool row, reading Prometheus collectors back, our metric
classes exposing what prometheus_client's do, deriving
series points from snapshots (per model too), the security verdicts, the loopback rule in
Settings, and strict JSON."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.config import Settings, is_loopback_host
from app.dashboard.derive import decorate, derive_point, raw_sample
from app.dashboard.feed import RecordCache, to_json_bytes
from app.dashboard.model_rows import model_rows
from app.dashboard.security import bearer_matches, host_allowed, same_origin
from app.dashboard.worker_snapshots import merge_snapshots
from app.models import ModelDirectory
from app.observe import metrics
from app.observe.backend_stats import BackendStats, backend_traffic, quantile
from app.observe.metric_summaries import counts_by_two_labels, summarize_by_label
from app.observe.request_log import MAX_TEXT, RequestLog, RequestRecord, clip, status_class
from app.observe.timeseries import Columns, CounterWindow


def test_counter_window_rates_ratios_and_lookback() -> None:
    window = CounterWindow(span=3)
    assert window.rate("a", 1) is None
    for t, a, b in [(0, 0, 0), (1, 10, 10), (2, 30, 10), (3, 30, 30), (4, 60, 30)]:
        window.push(float(t), {"a": float(a), "b": float(b)})
    assert len(window) == 4  # span + 1 kept
    assert window.rate("a", 1) == 30.0
    assert window.rate("a", 10) == pytest.approx((60 - 10) / 3)  # the oldest kept is t=1
    assert window.ratio("a", ("a", "b"), 1) == 1.0
    assert window.ratio("a", ("a", "b"), 3) == pytest.approx(50 / 70)
    assert window.latest("b") == 30.0
    assert window.rate("missing", 1) is None


def test_counter_window_new_counter_counts_from_zero_and_reset_is_unknown() -> None:
    window = CounterWindow(span=2)
    window.push(0.0, {})
    window.push(1.0, {"late": 5.0, "reset": 10.0})
    assert window.delta("late", 1) == 5.0
    window.push(2.0, {"late": 6.0, "reset": 2.0})
    assert window.delta("reset", 1) is None
    assert window.ratio("late", ("late",), 1) == 1.0
    window.push(3.0, {"late": 6.0, "reset": 2.0})
    assert window.ratio("late", ("late",), 1) is None  # nothing grew: no ratio, not 0/0


def test_counter_window_histogram_of_the_recent_ticks() -> None:
    window = CounterWindow(span=2)
    bounds = [0.001, 0.01]
    window.push(0.0, {"h.0": 100.0, "h.1": 0.0, "h.2": 0.0})
    window.push(1.0, {"h.0": 150.0, "h.1": 0.0, "h.2": 0.0})
    window.push(2.0, {"h.0": 150.0, "h.1": 2.0, "h.2": 1.0})
    last = window.histogram(["h.0", "h.1", "h.2"], bounds, 1)
    assert [b["count"] for b in last["buckets"]] == [0.0, 2.0, 1.0]
    assert last["count"] == 3.0
    both = window.histogram(["h.0", "h.1", "h.2"], bounds, 2)
    assert both["count"] == 53.0 and both["p50"] is not None and both["p50"] <= 0.001
    with pytest.raises(ValueError):
        window.histogram(["h.0"], bounds, 1)


def test_columns_pad_late_series_and_stay_bounded() -> None:
    columns = Columns(capacity=3, max_columns=2)
    columns.append(1.0, {"a": 1.0})
    columns.append(2.0, {"a": 2.0, "b": 20.0, "c": 300.0})  # c: over max_columns
    columns.append(3.0, {"b": 30.0})
    columns.append(4.0, {"a": 4.0, "b": 40.0})
    data = columns.to_json()
    assert data == {"t": [2.0, 3.0, 4.0], "a": [2.0, None, 4.0], "b": [20.0, 30.0, 40.0]}
    assert len(columns) == 3
    # What came since a count of points appended: the newest, never more than it keeps.
    assert columns.appended == 4
    assert columns.tail(1) == {"t": [4.0], "a": [4.0], "b": [40.0]}
    two = {"t": [3.0, 4.0], "a": [None, 4.0], "b": [30.0, 40.0]}
    assert columns.tail(columns.appended - 2) == two
    assert columns.tail(9) == data and columns.tail(0) == {"t": [], "a": [], "b": []}


def record(seq: int, status: int = 200, **overrides: Any) -> RequestRecord:
    base: RequestRecord = {
        "seq": seq,
        "time": 1.0,
        "id": "r",
        "kind": "chat",
        "model": "m",
        "stream": False,
        "backend": "http://b",
        "route": "p:r",
        "prompt_tokens": 3,
        "tokenize_path": "l0",
        "template_ms": 0.1,
        "tokenize_ms": 0.1,
        "route_ms": 0.01,
        "status": status,
        "ttft_ms": 1.0,
        "duration_ms": 2.0,
        "client_gone": False,
    }
    base.update(overrides)  # type: ignore[typeddict-item]
    return base


@dataclass
class Finished:
    status: int

    def record(self, seq: int) -> RequestRecord:
        return record(seq, self.status)


def test_request_log_keeps_the_newest_and_counts_classes() -> None:
    log = RequestLog(capacity=3)
    for status in [200, 500, 400, 200, 499]:
        log.add(Finished(status))
    assert [(r["seq"], r["status"]) for r in log.recent()] == [(5, 499), (4, 200), (3, 400)]
    assert log.total == 5 and len(log) == 3
    assert log.by_class == {"2xx": 2, "5xx": 1, "4xx": 1, "client_gone": 1}
    assert log.server_errors == 1
    assert status_class(503) == "5xx"
    with pytest.raises(ValueError):
        RequestLog(0)


def test_a_request_logs_record_is_made_once_and_forgotten_with_it() -> None:
    made: list[int] = []

    @dataclass
    class Counted(Finished):
        def record(self, seq: int) -> RequestRecord:
            made.append(seq)
            return super().record(seq)

    log = RequestLog(capacity=3)
    for _ in range(3):
        log.add(Counted(200))
    first = log.recent()
    assert log.recent() == first and made == [3, 2, 1]  # asked twice, made once
    log.add(Counted(200))
    assert [r["seq"] for r in log.recent()] == [4, 3, 2] and made == [3, 2, 1, 4]
    assert set(log._made) == {4, 3, 2}  # bounded by the log


def test_clip_bounds_client_text() -> None:
    assert clip("model") == "model"
    assert clip(None) is None and clip(42) is None
    long = clip("x" * 10_000)
    assert long is not None and len(long) == MAX_TEXT and long.endswith("…")


def test_quantile() -> None:
    assert quantile([], 0.5) is None
    assert quantile([1.0], 0.99) == 1.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


def test_backend_stats_window_reasons_and_bounds() -> None:
    stats = BackendStats(window_s=10.0, max_samples=100, max_backends=2, max_reasons=2)
    for i in range(10):
        stats.record("http://a", now=float(i), ttft_s=0.1 * (i + 1), reason="tie")
    stats.record("http://a", now=10.0, ttft_s=None, reason="less_loaded")
    stats.record("http://a", now=10.0, ttft_s=None, reason="retry")  # third reason: "other"
    stats.record("http://b", now=0.0, ttft_s=5.0, reason=None)
    stats.record("http://c", now=0.0, ttft_s=5.0, reason=None)  # over max_backends
    snap = stats.snapshot(now=15.0)
    assert set(snap) == {"http://a", "http://b"}
    a = snap["http://a"]
    assert a["answered"] == 12
    assert a["ttft_samples"] == 5  # only t >= 5 is within 10 s of now=15
    assert a["ttft_p50_s"] == pytest.approx(0.8)
    assert a["route_reasons"] == {"tie": 10, "less_loaded": 1, "other": 1}
    assert snap["http://b"]["ttft_samples"] == 0 and snap["http://b"]["ttft_p50_s"] is None


def test_backend_traffic_from_codes_and_stats() -> None:
    codes = {"http://a": {"200": 8.0, "503": 1.0, "error": 1.0}}
    stats = BackendStats()
    stats.record("http://a", 0.0, 0.2, "tie")
    a, b = (backend_traffic(url, codes, stats.snapshot(0.0)) for url in ("http://a", "http://b"))
    assert a["requests_total"] == 10
    assert a["errors_total"] == 2
    assert a["route_reasons"] == {"tie": 1}
    assert b["requests_total"] == 0 and b["ttft_p50_s"] is None


def test_summaries_read_labelled_prometheus_collectors() -> None:
    registry = CollectorRegistry()
    histogram = Histogram(
        "h_seconds", "h", ["path", "other"], buckets=(0.001, 0.01), registry=registry
    )
    histogram.labels("l0", "x").observe(0.0005)
    histogram.labels("l0", "y").observe(0.005)
    histogram.labels("thread", "x").observe(0.5)
    by_path = summarize_by_label(histogram, "path")
    assert [b["count"] for b in by_path["l0"]["buckets"]] == [1.0, 1.0, 0.0]
    assert [b["le"] for b in by_path["thread"]["buckets"]] == [0.001, 0.01, "+Inf"]
    assert by_path["thread"]["count"] == 1.0 and by_path["l0"]["sum"] == pytest.approx(0.0055)
    plain = Histogram("p_seconds", "p", buckets=(0.1,), registry=registry)
    assert summarize_by_label(plain, None)[""]["count"] == 0.0
    counter = Counter("c", "c", ["backend", "code"], registry=registry)
    counter.labels("a", "200").inc(3)
    counter.labels("a", "500").inc()
    assert counts_by_two_labels(counter, "backend", "code") == {"a": {"200": 3.0, "500": 1.0}}


def snapshot_at(
    lag_counts: list[float], hits: float, misses: float, total: float
) -> dict[str, Any]:
    les: list[Any] = [0.001, 0.01, "+Inf"]
    return {
        "loop": {
            "lag": {
                "buckets": [{"le": le, "count": c} for le, c in zip(les, lag_counts, strict=True)]
            },
            "stalls": {"buckets": [{"le": le, "count": 0.0} for le in les], "count": 0.0},
        },
        "preprocess": {"l0": {"hits": hits, "misses": misses}, "l1": {"enabled": False}},
        "tokenize": {
            "latency_by_path": {"l0": {"buckets": [{"le": le, "count": hits} for le in les]}},
            "saturated": {"waited": 0, "bailed_out": 0},
        },
        "requests": {"total": total, "by_class": {"2xx": total}},
        "backends": [{"url": "http://a", "traffic": {"requests_total": total, "errors_total": 0}}],
    }


def test_derive_points_and_decorate_from_snapshots() -> None:
    window = CounterWindow(span=60)
    first = snapshot_at([100.0, 0.0, 0.0], hits=0.0, misses=0.0, total=0.0)
    window.push(0.0, raw_sample(first, {}))
    assert derive_point(window, first)["lag_p99_ms"] is None
    second = snapshot_at([150.0, 50.0, 0.0], hits=3.0, misses=1.0, total=4.0)
    window.push(1.0, raw_sample(second, {"threads_busy": 1.0}))
    point = derive_point(window, second)
    assert point["l0_hit_pct"] == 75.0
    assert point["l1_hit_pct"] is None  # L1 off: no series value, not 0
    assert point["l0_token_pct"] is None  # preprocess.tokens not reported
    assert point["requests_per_s"] == 4.0
    assert point["backend_rps:http://a"] == 4.0
    assert point["threads_busy"] == 1.0
    assert point["lag_p99_ms"] is not None and 1.0 < point["lag_p99_ms"] <= 10.0
    decorate(second, window)
    assert second["requests"]["per_s"] == 4.0
    assert second["backends"][0]["traffic"]["requests_per_s"] == 4.0
    assert second["window"]["lag"]["count"] == 100.0
    assert second["window"]["tokenize"]["l0"]["count"] == 9.0


def engine(name: str, running: int, kv: float | None, hits: float | None) -> dict[str, Any]:
    return {
        "name": name,
        "running": running,
        "waiting": 1,
        "kv_cache_usage": kv,
        "prefix_cache_hit_rate": hits,
    }


def pool_backend(id_: str, serves: list[str], **fields: Any) -> dict[str, Any]:
    return {
        "id": id_,
        "role": "both",
        "serves": serves,
        "healthy": True,
        "breakers": {},
        "inflight": 1,
        "engine": None,
        "draining_for": None,
        **fields,
    }


def test_model_rows_sum_each_pool_and_count_its_requests_and_caches() -> None:
    directory = ModelDirectory(frozenset({"big", "small"}), {"alias": "big"}, {"small": 64})
    backends = [
        pool_backend("a", ["big"], engine=engine("vllm", 2, 0.5, 0.2)),
        pool_backend("ab", ["big", "small"], engine=engine("sglang", 3, None, 0.4)),
        pool_backend("b", ["small"], healthy=False, breakers={"small": "open"}),
    ]
    recent = [
        {"model": "big", "ttft_ms": 30.0},
        {"model": "big", "ttft_ms": 10.0},
        {"model": "small", "ttft_ms": None},
    ]
    rows = model_rows(
        directory,
        backends,
        {"small": {"tokenizer": "words", "chat_template": "chatml"}},
        {"tokenizer": "deepseek", "chat_template": "deepseek_v3"},
        {"big": {"200": 3.0, "502": 1.0, "404": 2.0}},
        {"l0_hits": {"big": 2.0}, "l0_misses": {"big": 1.0, "small": 4.0}},
        recent,
        {},
        {},
    )
    big, small = rows
    assert (big["name"], big["aliases"], big["configured"], big["tokenizer"]) == (
        "big",
        ["alias"],
        False,
        "deepseek",
    )
    assert big["pool"] == {
        "backends": ["a", "ab"],
        "healthy_backends": 2,
        "serving_backends": 2,
        "breakers_open": 0,
        "inflight": 2,
        "engines": ["sglang", "vllm"],
        "engine_running": 5,
        "engine_waiting": 2,
        "engine_kv_cache_usage": 0.5,  # only vLLM's is known
        "engine_prefix_cache_hit_rate": pytest.approx(0.3),
    }
    assert big["requests"]["total"] == 6 and big["requests"]["errors"] == 1
    assert big["requests"]["ttft_p50_ms"] == 20.0
    assert big["caches"] == {"l0_hits": 2, "l0_misses": 1, "l1_hits": 0, "l1_misses": 0}
    assert (small["max_model_len"], small["tokenizer"]) == (64, "words")
    assert small["pool"]["backends"] == ["ab", "b"]  # a backend serving two is in both
    assert (small["pool"]["serving_backends"], small["pool"]["breakers_open"]) == (1, 1)
    assert small["requests"]["total"] == 0 and small["requests"]["ttft_p50_ms"] is None


def test_derive_gives_each_model_its_rate_and_hit_rates() -> None:
    window = CounterWindow(span=60)
    snaps = []
    for t, total, hits, misses in [(0, 0, 0, 0), (1, 4, 3, 1)]:
        snap = snapshot_at([0.0, 0.0, 0.0], 0.0, 0.0, 0.0)
        snap["models"] = [
            {
                "name": "big",
                "requests": {"total": total, "errors": 0},
                "caches": {"l0_hits": hits, "l0_misses": misses, "l1_hits": 0, "l1_misses": 0},
            }
        ]
        window.push(float(t), raw_sample(snap, {}))
        snaps.append(snap)
    assert derive_point(window, snaps[-1])["model_rps:big"] == 4.0
    decorate(snaps[-1], window)
    model = snaps[-1]["models"][0]
    assert model["requests"]["per_s"] == 4.0
    assert (model["caches"]["l0_hit_pct"], model["caches"]["l1_hit_pct"]) == (75.0, None)


def test_derive_reads_token_weighted_hits_when_reported() -> None:
    window = CounterWindow(span=60)
    for t, prompt, l0, l1 in [(0, 0, 0, 0), (1, 1000, 600, 300)]:
        snap = snapshot_at([0.0, 0.0, 0.0], 0.0, 0.0, 0.0)
        snap["preprocess"]["tokens"] = {"prompt": prompt, "from_l0": l0, "from_l1": l1}
        window.push(float(t), raw_sample(snap, {}))
    point = derive_point(window, snap)
    assert point["l0_token_pct"] == 60.0 and point["l1_token_pct"] == 30.0


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_settings_refuse_a_reachable_dashboard_without_a_token() -> None:
    with pytest.raises(ValueError, match="--admin-token"):
        Settings(dashboard_host="0.0.0.0")
    assert Settings(dashboard_host="0.0.0.0", admin_token="s3cret").admin_token == "s3cret"
    with pytest.raises(ValueError, match="empty"):
        Settings(admin_token="  ")


def test_host_allowed_only_loopback_names_on_a_loopback_socket() -> None:
    assert host_allowed("127.0.0.1:8001", "127.0.0.1")
    assert host_allowed("localhost:8001", "127.0.0.1")
    assert host_allowed("[::1]:8001", "::1")
    assert not host_allowed("evil.example:8001", "127.0.0.1")  # DNS rebinding
    assert not host_allowed(None, "127.0.0.1")
    assert not host_allowed("[bad", "127.0.0.1")
    assert host_allowed("dash.internal:8001", "0.0.0.0")  # reachable socket: any name


def test_same_origin() -> None:
    host = "127.0.0.1:8001"
    assert same_origin(None, None, host)  # curl, scripts
    assert same_origin("http://127.0.0.1:8001", "same-origin", host)
    assert not same_origin("http://127.0.0.1:8000", None, host)  # another port
    assert not same_origin("https://evil.example", None, host)
    assert not same_origin("null", None, host)
    assert not same_origin(None, "cross-site", host)
    assert not same_origin("http://127.0.0.1:8001", "same-site", host)


def test_bearer_matches() -> None:
    assert bearer_matches("Bearer s3cret", "s3cret")
    assert bearer_matches("bearer  s3cret ", "s3cret")
    assert not bearer_matches("Bearer wrong", "s3cret")
    assert not bearer_matches("Basic s3cret", "s3cret")
    assert not bearer_matches(None, "s3cret")


def test_snapshot_json_is_strict_even_with_non_finite_numbers() -> None:
    payload = to_json_bytes({"a": math.nan, "b": [math.inf, 1.5], "c": {"d": -math.inf}})
    assert json.loads(payload) == {"a": None, "b": [None, 1.5], "c": {"d": None}}


def test_record_cache_serialises_each_record_once_and_splices_the_log_in() -> None:
    cache = RecordCache()
    snap: dict[str, Any] = {"a": 1, "requests": {"total": 2, "recent": [record(2), record(1)]}}
    first = cache.serialise(snap)
    assert json.loads(first) == json.loads(json.dumps(snap))
    assert snap["requests"]["recent"][0]["seq"] == 2  # the snapshot is left as it was
    snap["requests"]["recent"] = [record(3, model="a new one"), record(2)]
    second = json.loads(cache.serialise(snap))
    assert [r["seq"] for r in second["requests"]["recent"]] == [3, 2]
    assert second["requests"]["recent"][0]["model"] == "a new one"


def test_workers_snapshots_merge_each_model_by_name() -> None:
    def worker(total: int, inflight: int) -> dict[str, Any]:
        pool = {
            "backends": ["a"],
            "healthy_backends": 1,
            "serving_backends": 1,
            "breakers_open": 0,
            "inflight": inflight,
            "engines": ["vllm"],
            "engine_running": 3,
            "engine_waiting": 1,
            "engine_kv_cache_usage": 0.5,
            "engine_prefix_cache_hit_rate": 0.25,
        }
        requests = {"total": total, "errors": 0, "ttft_p50_ms": 10.0 * total}
        return {
            "models": [{"name": "big", "max_model_len": 100, "pool": pool, "requests": requests}]
        }

    (big,) = merge_snapshots([worker(2, 1), worker(3, 4)])["models"]
    assert (big["requests"]["total"], big["pool"]["inflight"]) == (5, 5)  # each worker's own
    assert (big["pool"]["engine_running"], big["pool"]["serving_backends"]) == (3, 1)  # shared
    assert (big["max_model_len"], big["requests"]["ttft_p50_ms"]) == (100, 30.0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.floats(min_value=0, max_value=200, allow_nan=False),
            st.sampled_from(["inc", "dec", "set"]),
        ),
        max_size=40,
    )
)
def test_our_metric_classes_expose_what_prometheus_clients_do(
    updates: list[tuple[str, float, str]],
) -> None:
    """app/observe/metrics.py's lock-free Counter, Gauge and Histogram, updated like
    prometheus_client's own, render the same exposition."""
    buckets = (0.1, 1.0, 10.0, 100.0)
    registries = []
    for counter, gauge, histogram in (
        (Counter, Gauge, Histogram),
        (metrics.Counter, metrics.Gauge, metrics.Histogram),
    ):
        registry = CollectorRegistry()
        c = counter("c_total", "c", ["k"], registry=registry)
        g = gauge("g", "g", ["k"], registry=registry)
        h = histogram("h_seconds", "h", ["k"], buckets=buckets, registry=registry)
        for label, value, op in updates:
            c.labels(k=label).inc(value)
            h.labels(k=label).observe(value)
            getattr(g.labels(k=label), op)(value)
        registries.append(generate_latest(registry))
    assert registries[0] == registries[1]
