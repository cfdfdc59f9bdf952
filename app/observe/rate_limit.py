"""A sliding-window rate limit for reports (log lines, warnings): pure, the caller passes
`now`. The stall detector and the dashboard's feed each keep one, so it lives on its own
rather than in either of them."""

from __future__ import annotations

from collections import deque


class RateLimiter:
    """At most `limit` admissions in any `period_s` window (sliding)."""

    def __init__(self, limit: int, period_s: float) -> None:
        self._period_s = period_s
        self._admitted: deque[float] = deque(maxlen=limit)
        self._suppressed = 0

    def admit(self, now: float) -> int | None:
        """None when over the limit; otherwise how many were refused since the last admission."""
        admitted = self._admitted
        if len(admitted) == admitted.maxlen and now - admitted[0] < self._period_s:
            self._suppressed += 1
            return None
        admitted.append(now)
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed
