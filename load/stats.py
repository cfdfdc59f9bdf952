"""Statistics for benchmark reports: percentiles and their confidence ranges, summaries of
rounds, SLOs and goodput. Pure."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

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


def _binomial_cdfs(n: int, p: float) -> list[float]:
    """[P(B <= k) for k in 0..n] for B ~ Binomial(n, p): exact up to 50 trials, normal beyond."""
    if n > 50:
        sd = math.sqrt(n * p * (1 - p)) or 1.0
        return [0.5 * (1 + math.erf((k + 0.5 - n * p) / (sd * math.sqrt(2)))) for k in range(n + 1)]
    cdfs, total = [], 0.0
    for k in range(n + 1):
        total += math.comb(n, k) * p**k * (1 - p) ** (n - k)
        cdfs.append(total)
    return cdfs


def quantile_range(
    values: Sequence[float], q: float, confidence: float = 0.95
) -> tuple[float, float]:
    """A distribution-free confidence range for the q-th percentile: the order statistics
    X(l) <= X(u) that hold it with probability >= `confidence` (binomial ranks). With too few
    values for that, the whole range (min, max): read it as "the rounds spread", not "95%"."""
    if not values:
        return float("nan"), float("nan")
    ordered = sorted(values)
    n, tail = len(ordered), (1 - confidence) / 2
    cdfs = _binomial_cdfs(n, q / 100)  # cdfs[j - 1]: P(fewer than j values below the quantile)
    low = max((j for j in range(1, n + 1) if cdfs[j - 1] <= tail), default=1)
    high = min((j for j in range(1, n + 1) if cdfs[j - 1] >= 1 - tail), default=n)
    return ordered[low - 1], ordered[high - 1]


class Ranged(NamedTuple):
    """A median over rounds and its confidence range, printed `12.3 (10.1-14.0)`."""

    value: float
    low: float
    high: float


def ranged(values: Sequence[float]) -> Ranged:
    if not values:
        nan = float("nan")
        return Ranged(nan, nan, nan)
    return Ranged(statistics.median(values), *quantile_range(values, 50))


def by_group(
    rows: Sequence[Mapping[str, Any]],
    key: str,
    columns: Sequence[str],
    worst: Sequence[str] = (),
    total: Sequence[str] = ("errors",),
) -> dict[str, dict[str, Any]]:
    """Rows of rounds grouped by `key` (in first-seen order): per group the median of each
    of `columns` with `<column>_range` [low, high], the maximum of `worst`, the sum of
    `total`, and the number of rounds."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(str(row[key]), []).append(row)
    out: dict[str, dict[str, Any]] = {}
    for name, members in groups.items():
        summary_: dict[str, Any] = {"rounds": len(members)}
        for column in columns:
            values = [float(m[column]) for m in members if not math.isnan(float(m[column]))]
            estimate = ranged(values)
            summary_[column] = estimate.value
            summary_[f"{column}_range"] = [estimate.low, estimate.high]
        for column in worst:
            summary_[column] = max(float(m[column]) for m in members)
        for column in total:
            summary_[column] = sum(m.get(column, 0) for m in members)
        out[name] = summary_
    return out


def paired_change(
    rows: Sequence[Mapping[str, Any]], column: str, variant: str, baseline: str
) -> Ranged:
    """`variant`'s `column` over `baseline`'s in the same round, minus 1, in percent: the
    median over rounds and its range. Neighbouring runs saw the same machine, so their ratio
    is what drift on a shared machine disturbs least."""
    by_round: dict[Any, dict[str, float]] = {}
    for row in rows:
        by_round.setdefault(row["round"], {})[row["variant"]] = float(row[column])
    changes = [
        (pair[variant] / pair[baseline] - 1) * 100
        for pair in by_round.values()
        if variant in pair and pair.get(baseline)
    ]
    return ranged([c for c in changes if not math.isnan(c)])


def with_range(summary_: Mapping[str, Any], column: str) -> Ranged:
    """A column of a `by_group` summary as a table cell with its range."""
    low, high = summary_[f"{column}_range"]
    return Ranged(summary_[column], low, high)


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
