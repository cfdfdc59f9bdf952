"""Per-backend traffic as the dashboard shows it: time to first byte over a recent window and
why the router sent requests there. Pure: the caller passes `now`.

Requests and errors per backend are not counted here: `sluice_backend_requests_total
{backend,code}` already counts every exchange, the failed tries that were retried elsewhere
included, and `backend_traffic` reads it. What only a finished request knows (when its first
byte left, which route reason won) is recorded here, for the backend that answered.

Bounded everywhere: backends (the pool is fixed, but a cap costs nothing), samples per
backend, reasons per backend.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

OTHER = "other"


def quantile(ordered: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks of an ascending sequence."""
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class AnsweredStats(TypedDict):
    """What the requests a backend answered say (over `ttft_window_s` for the TTFTs)."""

    answered: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_samples: int
    ttft_window_s: float | None  # None: it answered none yet
    route_reasons: dict[str, int]


class BackendTraffic(AnsweredStats):
    """A backend's `traffic` block in the dashboard's snapshot."""

    requests_total: int
    errors_total: int  # no answer, or a 5xx
    codes: dict[str, int]
    # Added by the dashboard's feed: over its last ticks.
    requests_per_s: NotRequired[float | None]
    errors_per_s: NotRequired[float | None]


@dataclass
class _Backend:
    samples: deque[tuple[float, float]]  # (when, time to first token in seconds)
    reasons: dict[str, int] = field(default_factory=dict)
    answered: int = 0


class BackendStats:
    def __init__(
        self,
        *,
        window_s: float = 60.0,
        max_samples: int = 1024,
        max_backends: int = 64,
        max_reasons: int = 16,
    ) -> None:
        self.window_s = window_s
        self._max_samples = max_samples
        self._max_backends = max_backends
        self._max_reasons = max_reasons
        self._backends: dict[str, _Backend] = {}

    def record(self, backend: str, now: float, ttft_s: float | None, reason: str | None) -> None:
        stats = self._backends.get(backend)
        if stats is None:
            if len(self._backends) >= self._max_backends:
                return
            stats = self._backends[backend] = _Backend(deque(maxlen=self._max_samples))
        stats.answered += 1
        if ttft_s is not None:
            stats.samples.append((now, ttft_s))
        if reason is not None:
            reasons = stats.reasons
            if reason not in reasons and len(reasons) >= self._max_reasons:
                reason = OTHER
            reasons[reason] = reasons.get(reason, 0) + 1

    def snapshot(self, now: float) -> dict[str, AnsweredStats]:
        """By backend URL: TTFT p50/p99 over the window, how many samples, route reasons."""
        result: dict[str, AnsweredStats] = {}
        for url, stats in self._backends.items():
            recent = sorted(t for when, t in stats.samples if now - when <= self.window_s)
            result[url] = {
                "answered": stats.answered,
                "ttft_p50_s": quantile(recent, 0.5),
                "ttft_p99_s": quantile(recent, 0.99),
                "ttft_samples": len(recent),
                "ttft_window_s": self.window_s,
                "route_reasons": dict(stats.reasons),
            }
        return result


def is_error_code(code: str) -> bool:
    """A code of `sluice_backend_requests_total`: "error" (no answer) or a 5xx answer."""
    return code == "error" or code.startswith("5")


def backend_traffic(
    url: str,
    codes: Mapping[str, Mapping[str, float]],
    stats: Mapping[str, AnsweredStats],
) -> BackendTraffic:
    """A backend's `traffic` block: `codes` by URL from `sluice_backend_requests_total`,
    `stats` from `BackendStats.snapshot`."""
    by_code = {code: int(n) for code, n in codes.get(url, {}).items()}
    answered = stats.get(url, _NONE_ANSWERED)
    return {
        "requests_total": sum(by_code.values()),
        "errors_total": sum(n for code, n in by_code.items() if is_error_code(code)),
        "codes": by_code,
        "answered": answered["answered"],
        "ttft_p50_s": answered["ttft_p50_s"],
        "ttft_p99_s": answered["ttft_p99_s"],
        "ttft_samples": answered["ttft_samples"],
        "ttft_window_s": answered["ttft_window_s"],
        "route_reasons": dict(answered["route_reasons"]),
    }


_NONE_ANSWERED: AnsweredStats = {
    "answered": 0,
    "ttft_p50_s": None,
    "ttft_p99_s": None,
    "ttft_samples": 0,
    "ttft_window_s": None,
    "route_reasons": {},
}
