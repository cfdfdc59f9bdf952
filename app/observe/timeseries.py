"""Time series for the dashboard, pure: the caller passes every time and every value.

- `CounterWindow` keeps the last few raw samples (cumulative counters, bucket counts, gauges)
  taken once a tick, so that rates, ratios and histograms over a trailing window are a
  subtraction between two samples: nothing is accumulated twice and nothing drifts.
- `Columns` keeps the derived points column by column, the shape a chart library plots,
  for a bounded history.

Both are bounded: a fixed number of samples or points, and at most `max_columns` series.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from itertools import islice

from app.errors import require_at_least
from app.observe.stalls import HistogramSummary, summarize_histogram

Sample = Mapping[str, float]
Point = Mapping[str, float | None]
# Column-wise points as the dashboard sends them: `t` (Unix time) and one list per series.
Series = dict[str, list[float | None]]


class CounterWindow:
    """The last `span + 1` samples: enough to look `span` ticks back."""

    def __init__(self, span: int) -> None:
        require_at_least(1, span=span)
        self.span = span
        self._samples: deque[tuple[float, Sample]] = deque(maxlen=span + 1)

    def push(self, now: float, sample: Sample) -> None:
        self._samples.append((now, sample))

    def __len__(self) -> int:
        return len(self._samples)

    def _ends(self, ticks: int) -> tuple[tuple[float, Sample], tuple[float, Sample]] | None:
        """The newest sample and the one `ticks` back (or the oldest kept)."""
        if len(self._samples) < 2:
            return None
        back = min(ticks, len(self._samples) - 1)
        return self._samples[-1 - back], self._samples[-1]

    def delta(self, key: str, ticks: int) -> float | None:
        """How much a counter grew over the last `ticks` ticks; None if unknown or reset.

        A counter missing from the older sample counts from 0 (a labelled child that did not
        exist yet); one missing from the newest is unknown.
        """
        ends = self._ends(ticks)
        if ends is None:
            return None
        (_, old), (_, new) = ends
        if key not in new or new[key] < old.get(key, 0.0):
            return None
        return new[key] - old.get(key, 0.0)

    def seconds(self, ticks: int) -> float | None:
        ends = self._ends(ticks)
        return None if ends is None else ends[1][0] - ends[0][0]

    def rate(self, key: str, ticks: int) -> float | None:
        """Growth per second of a counter over the last `ticks` ticks."""
        grew, seconds = self.delta(key, ticks), self.seconds(ticks)
        if grew is None or not seconds:
            return None
        return grew / seconds

    def ratio(self, part: str, whole: Sequence[str], ticks: int) -> float | None:
        """Δpart / Σ Δwhole over the last `ticks` ticks; None when the whole did not grow."""
        grew = self.delta(part, ticks)
        wholes = [self.delta(key, ticks) for key in whole]
        if grew is None or any(w is None for w in wholes):
            return None
        total = sum(w for w in wholes if w is not None)
        return grew / total if total > 0 else None

    def latest(self, key: str) -> float | None:
        return self._samples[-1][1].get(key) if self._samples else None

    def histogram(
        self, keys: Sequence[str], bounds: Sequence[float], ticks: int
    ) -> HistogramSummary:
        """The histogram of what was observed over the last `ticks` ticks.

        `keys` name the per-bucket (not cumulative) counts, one per bound plus +Inf, as
        `summarize_histogram` returns them; the answer has the same shape, with zeros when
        nothing is known yet.
        """
        deltas = [self.delta(key, ticks) or 0.0 for key in keys]
        cumulative: list[float] = []
        running = 0.0
        for count in deltas:
            running += count
            cumulative.append(running)
        if len(cumulative) != len(bounds) + 1:
            raise ValueError("keys need one count per bound plus +Inf")
        return summarize_histogram(bounds, cumulative, 0.0)


class Columns:
    """A ring of points stored column-wise: `t` plus one list per series.

    A series first seen late is padded with None for the points before it; a point that
    lacks a known series gets None there. Past `max_columns` series, new names are ignored.
    """

    def __init__(self, capacity: int, max_columns: int = 64) -> None:
        require_at_least(1, capacity=capacity)
        self.capacity = capacity
        self.max_columns = max_columns
        self._t: deque[float] = deque(maxlen=capacity)
        self._columns: dict[str, deque[float | None]] = {}
        self.appended = 0  # points appended in all: `tail(appended - earlier)` is what came since

    def append(self, t: float, point: Point) -> None:
        self.appended += 1
        self._t.append(t)
        for name, column in self._columns.items():
            column.append(point.get(name))
        for name, value in point.items():
            if name in self._columns or len(self._columns) >= self.max_columns:
                continue
            column = deque([None] * (len(self._t) - 1), maxlen=self.capacity)
            column.append(value)
            self._columns[name] = column

    def __len__(self) -> int:
        return len(self._t)

    def to_json(self) -> Series:
        return self.tail(len(self._t))

    def tail(self, points: int) -> Series:
        """The newest `points` points (at most all there are), column-wise like `to_json`."""
        start = max(len(self._t) - max(points, 0), 0)
        columns: Series = {"t": list(islice(self._t, start, None))}
        for name, column in self._columns.items():
            columns[name] = list(islice(column, start, None))
        return columns
