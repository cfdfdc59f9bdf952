"""The pure parts of `--workers N`: snapshots merged into one (counts added, settings kept,
worst-of kept, histograms re-summarised, backends by URL, stalls pooled), the request logs
interleaved under one rising `seq` across workers and restarts, the restart backoff of a
crash loop, and every worker's metrics under a `worker` label with one `# TYPE` per name."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.cli.supervisor import RestartBackoff, describe_exit
from app.dashboard.worker_snapshots import RecordLog, merge_snapshots
from app.observe.stalls import summarize_histogram
from app.observe.worker_metrics import merge_worker_metrics

BOUNDS = [0.001, 0.01, 0.1]


def histogram(cumulative: list[float], total: float, **extra: Any) -> dict[str, Any]:
    return {**summarize_histogram(BOUNDS, cumulative, total), **extra}


def worker_snapshot(
    requests: int, lag: list[float], worst: float, url_requests: int
) -> dict[str, Any]:
    return {
        "time": 10.0,
        "policy": "cache_aware",
        "requests": {"total": requests, "by_class": {"2xx": requests}, "capacity": 200},
        "loop": {
            "threshold_ms": 10.0,
            "lag": histogram(lag, 0.01, max_recent=worst, max_recent_window_s=10.0),
            "recent": [{"task": "t", "last_time": worst, "count": 1}],
        },
        "preprocess": {"saturation": "wait", "l0": {"hits": requests, "max_entries": 10000}},
        "backends": [
            {
                "url": "http://gpu-1",
                "inflight": 1,
                "healthy": True,
                "engine": {"running": 5, "kv_cache_usage": 0.5},
                "room": {"room": 4, "basis": "seen-full", "why": "ran 4", "most": 4},
                "queued": 1,
                "traffic": {"requests_total": url_requests, "ttft_p99_s": worst},
            }
        ],
    }


def test_counts_add_up_settings_stay_and_the_worst_is_kept() -> None:
    a = worker_snapshot(10, [5, 8, 9, 10], worst=0.02, url_requests=7)
    b = worker_snapshot(30, [1, 1, 20, 30], worst=0.05, url_requests=20)
    merged = merge_snapshots([a, b])
    assert merged["requests"]["total"] == 40
    assert merged["requests"]["by_class"] == {"2xx": 40}
    assert merged["requests"]["capacity"] == 200  # a setting, alike in every worker
    assert merged["loop"]["threshold_ms"] == 10.0
    assert merged["preprocess"] == {"saturation": "wait", "l0": {"hits": 40, "max_entries": 10000}}
    assert merged["loop"]["lag"]["max_recent"] == 0.05
    (backend,) = merged["backends"]
    assert backend["inflight"] == 2
    assert backend["traffic"] == {"requests_total": 27, "ttft_p99_s": 0.05}
    # The engine reports itself to every worker alike: not doubled; nor is its room, each
    # worker's judgement of one engine. Each worker's own requests in its queue add up.
    assert backend["engine"] == {"running": 5, "kv_cache_usage": 0.5}
    assert backend["room"] == {"room": 4, "basis": "seen-full", "why": "ran 4", "most": 4}
    assert backend["queued"] == 2


def test_histograms_are_merged_by_bucket_and_their_quantiles_recomputed() -> None:
    a = worker_snapshot(1, [5, 8, 9, 10], worst=0.02, url_requests=1)
    b = worker_snapshot(1, [1, 1, 20, 30], worst=0.05, url_requests=1)
    lag = merge_snapshots([a, b])["loop"]["lag"]
    expected = summarize_histogram(BOUNDS, [6, 9, 29, 40], 0.02)
    assert lag["buckets"] == expected["buckets"]
    for key in ("count", "sum", "p50", "p99"):
        assert lag[key] == pytest.approx(expected[key])


def test_backends_merge_by_url_and_stalls_are_pooled_newest_first_with_their_worker() -> None:
    a = worker_snapshot(1, [1, 1, 1, 1], worst=0.3, url_requests=1)
    b = worker_snapshot(1, [1, 1, 1, 1], worst=0.7, url_requests=1)
    b["backends"].append({"url": "http://gpu-2", "inflight": 3})
    merged = merge_snapshots([a, b])
    assert [entry["url"] for entry in merged["backends"]] == ["http://gpu-1", "http://gpu-2"]
    assert merged["backends"][1]["inflight"] == 3
    assert [(s["worker"], s["last_time"]) for s in merged["loop"]["recent"]] == [(1, 0.7), (0, 0.3)]


def test_one_snapshot_merges_to_itself_in_value() -> None:
    a = worker_snapshot(3, [1, 2, 3, 3], worst=0.01, url_requests=3)
    merged = merge_snapshots([a])
    assert merged["requests"] == a["requests"]
    assert merged["backends"] == a["backends"]


def records(*seqs: int) -> list[dict[str, Any]]:
    return [{"seq": seq, "id": f"r{seq}"} for seq in sorted(seqs, reverse=True)]


def test_the_request_logs_interleave_under_one_rising_seq() -> None:
    log = RecordLog(capacity=5)
    log.update(0, 1, records(1, 2))
    log.update(1, 1, records(1))
    log.update(0, 1, records(1, 2, 3))  # 1 and 2 were taken already
    shown = log.recent()
    assert [(r["worker"], r["id"], r["seq"]) for r in shown] == [
        (0, "r3", 4),
        (1, "r1", 3),
        (0, "r2", 2),
        (0, "r1", 1),
    ]
    assert log.taken(0, 1) == 3
    # A restarted worker counts from 1 again: its records are new, their seqs still rise.
    log.forget(0, 1)
    log.update(0, 2, records(1))
    assert log.recent()[0] == {"seq": 5, "id": "r1", "worker": 0}
    log.update(1, 1, records(2, 3, 4))
    assert len(log.recent()) == 5  # bounded
    assert [r["seq"] for r in log.recent()] == [8, 7, 6, 5, 4]


def test_a_crash_loop_backs_off_doubling_and_a_long_run_starts_over() -> None:
    backoff = RestartBackoff(initial=0.5, maximum=4.0, stable_after=60.0)
    assert [backoff.next_delay(1.0) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.next_delay(61.0) == 0.5  # it ran long enough: no crash loop
    assert backoff.next_delay(0.1) == 1.0


def test_exits_are_described_by_status_or_signal() -> None:
    assert describe_exit(1) == "exited with status 1"
    assert describe_exit(-9) == "was killed by SIGKILL"


WORKER_TEXT = """# HELP sluice_requests_total Requests
# TYPE sluice_requests_total counter
sluice_requests_total{code="200"} {n}
# HELP sluice_lag_seconds Lag
# TYPE sluice_lag_seconds histogram
sluice_lag_seconds_bucket{le="0.01"} 1.0
sluice_lag_seconds_bucket{le="+Inf"} 2.0
sluice_lag_seconds_count 2.0
sluice_lag_seconds_sum 0.5
"""


def test_every_worker_metric_gets_its_worker_label_under_one_type_line() -> None:
    texts = {i: WORKER_TEXT.replace("{n}", str(float(n))) for i, n in ((0, 3), (1, 5))}
    text = merge_worker_metrics(texts, {0: True, 1: True, 2: False}, {2: 4}).decode()
    assert text.count("# TYPE sluice_requests_total counter") == 1
    assert text.count("# TYPE sluice_lag_seconds histogram") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {s.labels["worker"]: s.value for s in families["sluice_requests"].samples}
    assert requests == {"0": 3.0, "1": 5.0}
    buckets = [s for s in families["sluice_lag_seconds"].samples if s.name.endswith("_bucket")]
    assert {(s.labels["worker"], s.labels["le"]) for s in buckets} == {
        ("0", "0.01"),
        ("0", "+Inf"),
        ("1", "0.01"),
        ("1", "+Inf"),
    }
    up = {s.labels["worker"]: s.value for s in families["sluice_worker_up"].samples}
    assert up == {"0": 1.0, "1": 1.0, "2": 0.0}
    restarts = {s.labels["worker"]: s.value for s in families["sluice_worker_restarts"].samples}
    assert restarts == {"0": 0.0, "1": 0.0, "2": 4.0}
