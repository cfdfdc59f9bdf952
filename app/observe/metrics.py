"""The kinds of Prometheus metric Sluice exports, made cheap for the event loop, and the
loop's own metrics.

Each room declares its metrics in a small class of its own (`LoopMetrics` here,
`PreprocessMetrics`, `RoutingMetrics`, ...) on a registry it is given; start-up makes one
registry per running proxy (app/cli/rooms.py), so that several proxies in one process (tests)
never share counters. The names, types, labels and help texts are a contract (README.md
lists them).

The `model` label is a served model's name (at most `app.models.MAX_MODELS` of them), or
"(none)" for a request refused before its model was known: a name a client made up is never
a label.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from copy import copy
from typing import Any, Self, cast

import prometheus_client
import trio
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.values import MutexValue

# The `*_created` series double the exposition and no dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

TOKENIZE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)
LOOP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

# Label values as given: positionally, or by name (in the order the call named them).
LabelKey = tuple[object, ...] | tuple[tuple[str, object], ...]


class _RemembersChildren:
    """A labelled metric whose children are made once: prometheus_client's `labels()`
    checks its arguments and takes a lock on every call (~2 us), and a request asks for a
    dozen. Bounded by the metric's own label values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._made: dict[LabelKey, Self] = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: object, **named: object) -> Self:
        key = tuple(named.items()) if named else values
        child = self._made.get(key)
        if child is None:
            child = self._made[key] = cast(Self, super().labels(*values, **named))  # type: ignore[misc]
        return child

    def remove(self, *values: object) -> None:
        self._made.clear()
        super().remove(*values)  # type: ignore[misc]


class _LoopValue:
    """One sample's value, changed on the event loop's thread only (every update of ours
    is made there), in place by the metrics below. prometheus_client's value takes a lock
    for each change, and its metrics check their labels first: ~0.5 µs an update, ~15
    updates a request."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.value = value

    def get(self) -> float:
        return self.value

    def set_exemplar(self, exemplar: object) -> None:
        raise NotImplementedError("exemplars are not kept")

    def get_exemplar(self) -> None:
        return None


class Counter(_RemembersChildren, prometheus_client.Counter):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = cast(MutexValue, _LoopValue())

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        self._value.value += amount


class Gauge(_RemembersChildren, prometheus_client.Gauge):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = cast(MutexValue, _LoopValue())

    def inc(self, amount: float = 1) -> None:
        self._value.value += amount

    def dec(self, amount: float = 1) -> None:
        self._value.value -= amount

    def set(self, value: float) -> None:
        self._value.set(float(value))


class Histogram(_RemembersChildren, prometheus_client.Histogram):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum = cast(MutexValue, _LoopValue())
        self._buckets = [cast(MutexValue, _LoopValue()) for _ in self._upper_bounds]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        self._sum.value += amount
        # The first bucket whose upper bound is >= amount, as prometheus_client counts it.
        self._buckets[bisect_left(self._upper_bounds, amount)].value += 1


class ReadAtScrape(Collector):
    """A collector whose families are made when scraped, from counts kept elsewhere. It
    describes nothing: the names are fixed in its `collect`, and a registry that asked would
    collect once at registration to learn them."""

    def describe(self) -> list[Metric]:
        return []


class LabelledReading(Collector):
    """A gauge whose labelled values are read when scraped, from counts the proxy keeps
    anyway (`set_function` for a labelled gauge). A request in flight on a backend moved
    such a gauge twice, through two label lookups; this reads the pool instead. Nothing is
    read until `set_function` is given the reader."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: tuple[str, ...],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = list(labels)
        self._read: Callable[[], Iterable[tuple[str | tuple[str, ...], float]]] = tuple
        registry.register(self)

    def set_function(
        self, read: Callable[[], Iterable[tuple[str | tuple[str, ...], float]]]
    ) -> None:
        """`read` gives (label value or values, value) pairs at each scrape."""
        self._read = read

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self._name, self._documentation, labels=self._labels)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._documentation, labels=self._labels)
        for label_values, value in self._read():
            values = [label_values] if isinstance(label_values, str) else list(label_values)
            family.add_metric(values, value)
        yield family


class Declare:
    """Declares a room's metrics on the registry it was given: one call a metric (its name,
    help text and label names), so that a room's metrics read as a list."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, documentation, labels, registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, documentation, labels, registry=self.registry)

    def histogram(
        self, name: str, documentation: str, labels: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def reading(self, name: str, documentation: str, labels: Sequence[str] = ()) -> LabelledReading:
        return LabelledReading(name, documentation, tuple(labels), registry=self.registry)


class LoopMetrics:
    """The event loop's: how late the lag probe woke, and the stalls the monitor caught."""

    def __init__(self, registry: CollectorRegistry) -> None:
        declare = Declare(registry)
        self.loop_lag_seconds = declare.histogram(
            "sluice_event_loop_lag_seconds", "How late the lag probe woke up", buckets=LOOP_BUCKETS
        )
        self.loop_stalls = declare.counter(
            "sluice_event_loop_stalls",
            "Event-loop stalls longer than the threshold, by task step ((unknown): found by "
            "the lag probe) and cause (blocking, gil-wait, preempted; unknown without clocks)",
            ["task", "cause"],
        )
        self.loop_stall_seconds = declare.histogram(
            "sluice_event_loop_stall_seconds",
            "Duration of event-loop stalls longer than the threshold",
            buckets=LOOP_BUCKETS,
        )
        self.loop_stall_stage_seconds = declare.histogram(
            "sluice_event_loop_stall_stage_seconds",
            "Duration of event-loop stalls by stage (the innermost frame of Sluice's code on "
            "the stall's stack, else its request phase) and cause",
            ["stage", "cause"],
            buckets=LOOP_BUCKETS,
        )


# Series formatted in one step of the loop: prometheus_client formats ~8 us a series, and
# 1,000 backends make five gauges of 1,000 series each (~10 ms apiece, 65 ms in all).
SERIES_PER_STEP = 250


class _Families:
    """A registry of the given metric families, as `generate_latest` reads a registry."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


async def exposition_in_slices(registry: CollectorRegistry) -> bytes:
    """`registry`'s Prometheus text, at most `SERIES_PER_STEP` series a step of the loop (and
    one collector's `collect`): it grows with the fleet. A family cut in pieces keeps one
    HELP and TYPE (created series, which would close a family with their own, are off)."""
    parts: list[bytes] = []
    # prometheus_client keeps its collectors there, in registration order (its own collect()
    # walks the same dict).
    for collector in list(registry._collector_to_names):
        families = list(collector.collect())
        await trio.lowlevel.checkpoint()
        formatted = 0
        for family in families:
            samples = family.samples
            for first in range(0, max(len(samples), 1), SERIES_PER_STEP):
                piece = copy(family)
                piece.samples = samples[first : first + SERIES_PER_STEP]
                text = generate_latest(cast(CollectorRegistry, _Families([piece])))
                parts.append(text.split(b"\n", 2)[2] if first else text)
                formatted += len(piece.samples)
                if formatted >= SERIES_PER_STEP:
                    formatted = 0
                    await trio.lowlevel.checkpoint()
    return b"".join(parts)
