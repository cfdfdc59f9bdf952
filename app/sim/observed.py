"""What the simulated engine observes of its requests' times, as vLLM's histograms keep it:
cumulative bucket counts, a sum and a count. Pure."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM V1's buckets (vllm/v1/metrics/loggers.py): time in the queue, and between two tokens.
QUEUE_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                      50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


@dataclass
class Observed:
    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket (not cumulative), +Inf last
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += times
        self.total += seconds * times
        self.count += times

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (upper bound, count) pairs, +Inf last, as Prometheus writes them."""
        out, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out
