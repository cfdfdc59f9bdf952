"""Statistics for benchmark reports: percentiles, summaries, SLOs and goodput. Pure."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

# The latencies a record may carry, and the names `--slo` accepts for them.
SLO_METRICS = ("ttft", "itl", "tpot", "e2e")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks
    (numpy's default method); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """count, mean, p50, p90, p99 and max, each value multiplied by `scale` (1e3: ms)."""
    if not values:
        nan = float("nan")
        return {"count": 0, "mean": nan, "p50": nan, "p90": nan, "p99": nan, "max": nan}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "mean": sum(ordered) / len(ordered) * scale,
        "p50": percentile(ordered, 50) * scale,
        "p90": percentile(ordered, 90) * scale,
        "p99": percentile(ordered, 99) * scale,
        "max": ordered[-1] * scale,
    }


def parse_slos(specs: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "e2e:2000"]` (milliseconds) -> `{"ttft": 0.5, "e2e": 2.0}` (seconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"an SLO is METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}")
        milliseconds = float(value)
        if not milliseconds > 0:
            raise ValueError(f"SLO {spec!r}: the limit must be positive milliseconds")
        slos[name] = milliseconds / 1000
    return slos


def meets(latencies: Mapping[str, float | None], slos: Mapping[str, float]) -> bool:
    """True when every SLO'd latency is known and within its limit."""
    for name, limit in slos.items():
        value = latencies.get(name)
        if value is None or math.isnan(value) or value > limit:
            return False
    return True


def goodput(
    records: Sequence[Mapping[str, float | None]], slos: Mapping[str, float], seconds: float
) -> float:
    """Successful requests per second that met every SLO (records hold `ok` as 1.0 or 0.0)."""
    if seconds <= 0:
        return float("nan")
    good = sum(1 for r in records if r.get("ok") and meets(r, slos))
    return good / seconds


def mean_or_nan(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
