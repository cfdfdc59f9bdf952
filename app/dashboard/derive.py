"""From snapshots to what changes over time: pure functions of a snapshot and a
`CounterWindow` of past samples (no Trio, no clock of their own).

Once a tick the feed flattens the snapshot's cumulative counters, bucket counts and the
occupancy peaks seen since the last tick into a `raw_sample`; `derive_point` turns the
window of samples into one point of every chart's series, and `decorate` adds to a snapshot
what only the window knows: current rates, and histograms of the last minute (a histogram
since start-up would hide this minute's burst under hours of quiet).

Series names (`series` in `/api/snapshot`, units in the name): `lag_p50_ms`, `lag_p99_ms`,
`stalls_per_s`, `l0_hit_pct`, `l1_hit_pct` (by requests), `l0_token_pct`, `l1_token_pct`
(by tokens: prompt tokens served from that cache / prompt tokens), `threads_busy`,
`queued`, `saturated_waiting`, `fallback_busy` (peaks during the tick), `waited_per_s`,
`bailed_out_per_s`, `requests_per_s`, `errors_per_s`, `backend_rps:<url>` per backend and
`model_rps:<name>` per served model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from app.dashboard.model_rows import CACHE_COUNTERS
from app.dashboard.snapshot import Snapshot
from app.observe.stalls import HistogramSummary
from app.observe.timeseries import CounterWindow

RATE_TICKS = 10  # rates and hit ratios shown as numbers: over the last 10 ticks
CHART_RATE_TICKS = 5  # request rates in charts: smoothed over 5 ticks
HISTOGRAM_TICKS = 60  # histograms on the page: the last 60 ticks
PEAKS = ("threads_busy", "queued", "saturated_waiting", "fallback_busy")


def _bucket_counts(summary: HistogramSummary | None) -> list[float]:
    if not summary:
        return []
    return [float(bucket["count"]) for bucket in summary.get("buckets", ())]


def _bounds(summary: HistogramSummary | None) -> list[float]:
    if not summary:
        return []
    return [float(b["le"]) for b in summary.get("buckets", ()) if b["le"] != "+Inf"]


def _put_buckets(sample: dict[str, float], prefix: str, summary: HistogramSummary | None) -> None:
    for index, count in enumerate(_bucket_counts(summary)):
        sample[f"{prefix}.{index}"] = count


def raw_sample(snapshot: Snapshot, peaks: Mapping[str, float]) -> dict[str, float]:
    """The snapshot's cumulative numbers, flattened; `peaks` are gauges' maxima this tick."""
    sample: dict[str, float] = {f"peak.{name}": float(peaks.get(name, 0.0)) for name in PEAKS}
    loop = snapshot.get("loop", {})
    _put_buckets(sample, "lag", loop.get("lag"))
    _put_buckets(sample, "stall", loop.get("stalls"))
    sample["stalls"] = float(loop.get("stalls", {}).get("count", 0.0))
    pre = snapshot.get("preprocess", {})
    l0 = pre.get("l0")
    if l0:
        sample["l0.hits"] = float(l0["hits"])
        sample["l0.misses"] = float(l0["misses"])
    l1 = pre.get("l1")
    if l1 and "hits" in l1 and "misses" in l1:
        sample["l1.hits"] = float(l1["hits"])
        sample["l1.misses"] = float(l1["misses"])
    tokens = pre.get("tokens")
    if tokens:
        sample["tokens.prompt"] = float(tokens["prompt"])
        sample["tokens.from_l0"] = float(tokens["from_l0"])
        sample["tokens.from_l1"] = float(tokens["from_l1"])
    tokenize = snapshot.get("tokenize", {})
    for path, summary in tokenize.get("latency_by_path", {}).items():
        _put_buckets(sample, f"tok.{path}", summary)
    saturated = tokenize.get("saturated", {})
    sample["sat.waited"] = float(saturated.get("waited", 0))
    sample["sat.bailed_out"] = float(saturated.get("bailed_out", 0))
    requests = snapshot.get("requests", {})
    sample["req.total"] = float(requests.get("total", 0))
    sample["req.errors"] = float(requests.get("by_class", {}).get("5xx", 0))
    for backend in snapshot.get("backends", ()):
        traffic = backend.get("traffic") or {}
        sample[f"be.{backend['url']}.requests"] = float(traffic.get("requests_total", 0))
        sample[f"be.{backend['url']}.errors"] = float(traffic.get("errors_total", 0))
    for model in snapshot.get("models", ()):
        prefix = f"mod.{model['name']}"
        sample[f"{prefix}.requests"] = float(model["requests"]["total"])
        sample[f"{prefix}.errors"] = float(model["requests"]["errors"])
        caches = model["caches"]
        for counter in CACHE_COUNTERS:
            sample[f"{prefix}.{counter}"] = float(caches[counter])
    return sample


def _pct(value: float | None) -> float | None:
    return None if value is None else value * 100


def _lag_quantiles(
    window: CounterWindow, bounds: Sequence[float]
) -> tuple[float | None, float | None]:
    """p50 and p99 of the lag probes of the last tick, in ms."""
    if not bounds:
        return None, None
    keys = [f"lag.{i}" for i in range(len(bounds) + 1)]
    summary = window.histogram(keys, bounds, 1)
    p50, p99 = summary["p50"], summary["p99"]
    return (
        None if p50 is None else p50 * 1000,
        None if p99 is None else p99 * 1000,
    )


def derive_point(window: CounterWindow, snapshot: Snapshot) -> dict[str, float | None]:
    """One point of every series, from the window whose newest sample is `snapshot`'s."""
    lag_p50, lag_p99 = _lag_quantiles(window, _bounds(snapshot.get("loop", {}).get("lag")))
    point: dict[str, float | None] = {
        "lag_p50_ms": lag_p50,
        "lag_p99_ms": lag_p99,
        "stalls_per_s": window.rate("stalls", 1),
        "l0_hit_pct": _pct(window.ratio("l0.hits", ("l0.hits", "l0.misses"), RATE_TICKS)),
        "l1_hit_pct": _pct(window.ratio("l1.hits", ("l1.hits", "l1.misses"), RATE_TICKS)),
        "l0_token_pct": _pct(window.ratio("tokens.from_l0", ("tokens.prompt",), RATE_TICKS)),
        "l1_token_pct": _pct(window.ratio("tokens.from_l1", ("tokens.prompt",), RATE_TICKS)),
        "waited_per_s": window.rate("sat.waited", 1),
        "bailed_out_per_s": window.rate("sat.bailed_out", 1),
        "requests_per_s": window.rate("req.total", CHART_RATE_TICKS),
        "errors_per_s": window.rate("req.errors", CHART_RATE_TICKS),
    }
    for name in PEAKS:
        point[name] = window.latest(f"peak.{name}")
    for backend in snapshot.get("backends", ()):
        url = backend["url"]
        point[f"backend_rps:{url}"] = window.rate(f"be.{url}.requests", CHART_RATE_TICKS)
    for model in snapshot.get("models", ()):
        name = model["name"]
        point[f"model_rps:{name}"] = window.rate(f"mod.{name}.requests", CHART_RATE_TICKS)
    return point


def _window_histogram(
    window: CounterWindow, prefix: str, summary: HistogramSummary | None
) -> HistogramSummary | None:
    bounds = _bounds(summary)
    if not bounds:
        return None
    keys = [f"{prefix}.{i}" for i in range(len(bounds) + 1)]
    return window.histogram(keys, bounds, HISTOGRAM_TICKS)


def decorate(snapshot: Snapshot, window: CounterWindow) -> None:
    """Add current rates and last-minute histograms to `snapshot` (in place)."""
    loop = snapshot.get("loop", {})
    tokenize = snapshot.get("tokenize", {})
    snapshot["window"] = {
        "seconds": window.seconds(HISTOGRAM_TICKS),
        "lag": _window_histogram(window, "lag", loop.get("lag")),
        "stalls": _window_histogram(window, "stall", loop.get("stalls")),
        "tokenize": {
            path: _window_histogram(window, f"tok.{path}", summary)
            for path, summary in tokenize.get("latency_by_path", {}).items()
        },
    }
    requests = snapshot.get("requests")
    if requests:
        requests["per_s"] = window.rate("req.total", RATE_TICKS)
        requests["errors_per_s"] = window.rate("req.errors", RATE_TICKS)
    for backend in snapshot.get("backends", ()):
        traffic = backend.get("traffic")
        if traffic:
            url = backend["url"]
            traffic["requests_per_s"] = window.rate(f"be.{url}.requests", RATE_TICKS)
            traffic["errors_per_s"] = window.rate(f"be.{url}.errors", RATE_TICKS)
    for model in snapshot.get("models", ()):
        prefix = f"mod.{model['name']}"
        model["requests"]["per_s"] = window.rate(f"{prefix}.requests", RATE_TICKS)
        model["requests"]["errors_per_s"] = window.rate(f"{prefix}.errors", RATE_TICKS)
        caches = model["caches"]
        caches["l0_hit_pct"] = _hit_pct(window, f"{prefix}.l0")
        caches["l1_hit_pct"] = _hit_pct(window, f"{prefix}.l1")


def _hit_pct(window: CounterWindow, prefix: str) -> float | None:
    hits, misses = f"{prefix}_hits", f"{prefix}_misses"
    return _pct(window.ratio(hits, (hits, misses), RATE_TICKS))
