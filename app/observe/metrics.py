"""Every Prometheus metric Sluice exports; the names are a contract (README.md lists them).

One `Metrics` object per running proxy, each with its own registry, so that several proxies
in one process (tests) never share counters.

The `model` label is a served model's name (at most `app.models.MAX_MODELS` of them), or
"(none)" for a request refused before its model was known: a name a client made up is never
a label.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Self, cast

import prometheus_client
import trio
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.values import MutexValue

from app.observe.admission_stats import WAIT_BUCKETS, AdmissionStats
from app.observe.request_trace import TrafficRecorder

# The `*_created` series double the exposition and no dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

TOKENIZE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)
LOOP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# The decision alone: tens of microseconds to a few milliseconds.
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

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


class LabelledReading(Collector):
    """A gauge whose labelled values are read when scraped, from counts the proxy keeps
    anyway (`set_function` for a labelled gauge). A request in flight on a backend moved
    such a gauge twice, through two label lookups; this reads the pool instead. Nothing is
    read until `set_function` is given the reader."""

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str | tuple[str, ...],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = [label] if isinstance(label, str) else list(label)
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


class Metrics:
    def __init__(self, clock: Callable[[], float] = trio.current_time) -> None:
        """`clock`: the loop's, for what is counted by the second (admission's window)."""
        r = self.registry = CollectorRegistry()

        # Preprocessing.
        self.tokenize_seconds = Histogram(
            "sluice_tokenize_seconds",
            "Time to obtain a prompt's token ids, by the path that produced them and model",
            ["path", "model"],
            buckets=TOKENIZE_BUCKETS,
            registry=r,
        )
        self.template_seconds = Histogram(
            "sluice_template_seconds",
            "Time to render a chat template, by model",
            ["model"],
            buckets=TOKENIZE_BUCKETS,
            registry=r,
        )
        self.l0_hits = Counter(
            "sluice_tokenizer_cache_l0_hits", "L0 exact-match cache hits", ["model"], registry=r
        )
        self.l0_misses = Counter(
            "sluice_tokenizer_cache_l0_misses",
            "L0 exact-match cache misses",
            ["model"],
            registry=r,
        )
        self.l0_entries = Gauge(
            "sluice_tokenizer_cache_l0_entries", "Entries in the L0 cache", registry=r
        )
        self.l0_memory_bytes = Gauge(
            "sluice_tokenizer_cache_l0_memory_bytes", "Bytes held by the L0 cache", registry=r
        )
        self.l1_hits = Counter(
            "sluice_tokenizer_cache_l1_hits", "L1 prefix cache hits", ["model"], registry=r
        )
        self.l1_misses = Counter(
            "sluice_tokenizer_cache_l1_misses", "L1 prefix cache misses", ["model"], registry=r
        )
        self.l1_memory_bytes = Gauge(
            "sluice_tokenizer_cache_l1_memory_bytes", "Bytes held by the L1 cache", registry=r
        )
        self.l1_mismatches = Counter(
            "sluice_tokenizer_cache_l1_mismatches",
            "L1 results that differed from a full encode and were discarded",
            ["model"],
            registry=r,
        )
        self.tokenize_saturated = Counter(
            "sluice_tokenize_saturated",
            "Requests that found threads and the fallback permit busy",
            ["outcome"],
            registry=r,
        )
        self.tokenize_queue_depth = Gauge(
            "sluice_tokenize_queue_depth", "Requests waiting for a tokenizer thread", registry=r
        )
        self.render_queue_depth = Gauge(
            "sluice_render_queue_depth", "Requests waiting for a render worker process", registry=r
        )
        self.l0_hit_tokens = Counter(
            "sluice_tokenizer_cache_l0_hit_tokens",
            "Prompt tokens served by L0 hits",
            ["model"],
            registry=r,
        )
        self.l1_hit_tokens = Counter(
            "sluice_tokenizer_cache_l1_hit_tokens",
            "Prompt tokens served from L1's cached prefixes",
            ["model"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens",
            "Prompt tokens counted, by API key (its fingerprint) and model",
            ["api_key", "model"],
            registry=r,
        )
        self.requests = Counter(
            "sluice_requests",
            "Requests answered, by model, status code and endpoint (chat, responses, ...)",
            ["model", "code", "endpoint"],
            registry=r,
        )
        self.untidy_streams = Counter(
            "sluice_untidy_streams",
            "Streams cut after their engine had finished them (ended cleanly all the same)",
            ["endpoint"],
            registry=r,
        )

        # Event loop.
        self.loop_lag_seconds = Histogram(
            "sluice_event_loop_lag_seconds",
            "How late the lag probe woke up",
            buckets=LOOP_BUCKETS,
            registry=r,
        )
        self.loop_stalls = Counter(
            "sluice_event_loop_stalls",
            "Event-loop stalls longer than the threshold, by task step ((unknown): found by "
            "the lag probe) and cause (blocking, gil-wait, preempted; unknown without clocks)",
            ["task", "cause"],
            registry=r,
        )
        self.loop_stall_seconds = Histogram(
            "sluice_event_loop_stall_seconds",
            "Duration of event-loop stalls longer than the threshold",
            buckets=LOOP_BUCKETS,
            registry=r,
        )
        self.loop_stall_stage_seconds = Histogram(
            "sluice_event_loop_stall_stage_seconds",
            "Duration of event-loop stalls by stage (the innermost frame of Sluice's code on "
            "the stall's stack, else its request phase) and cause",
            ["stage", "cause"],
            buckets=LOOP_BUCKETS,
            registry=r,
        )

        # Backends and routing.
        self.backend_inflight = LabelledReading(
            "sluice_backend_inflight_requests", "Requests in flight", "backend", registry=r
        )
        self.backend_healthy = Gauge(
            "sluice_backend_healthy", "1 if the backend takes traffic", ["backend"], registry=r
        )
        self.backend_requests = Counter(
            "sluice_backend_requests",
            "Requests forwarded, by backend and HTTP status (0: no response)",
            ["backend", "code"],
            registry=r,
        )
        self.route_decisions = Counter(
            "sluice_route_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.proxy_overhead_seconds = Histogram(
            "sluice_proxy_overhead_seconds",
            "Time the proxy adds before the request is handed to a backend",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.epp_decision_seconds = Histogram(
            "sluice_epp_decision_seconds",
            "The endpoint picker's own time for a request: its body's last byte in to its "
            "endpoints out, less rendering, tokenizing and the time it was held for room",
            buckets=DECISION_BUCKETS,
            registry=r,
        )

        # Not exported: the dashboard's request log and per-backend first-token times,
        # which the proxy feeds through `traffic.trace(...)` (observe/request_trace.py).
        self.traffic = TrafficRecorder()

        # Routing checked against the backends' reported prefix-cache hits, and admission.
        self.route_predictions = Counter(
            "sluice_route_predictions",
            "cache_aware predictions by outcome against the backend's reported cached tokens "
            "(hit, miss, false-hit, surprise-hit, unreported)",
            ["outcome"],
            registry=r,
        )
        self.route_predicted_tokens = Counter(
            "sluice_route_predicted_cached_tokens",
            "Prompt tokens cache_aware predicted the backend had in its prefix cache",
            ["backend"],
            registry=r,
        )
        self.route_reported_cached_tokens = Counter(
            "sluice_route_reported_cached_tokens",
            "Prompt tokens the backend reported served from its prefix cache",
            ["backend"],
            registry=r,
        )
        self.route_reported_prompt_tokens = Counter(
            "sluice_route_reported_prompt_tokens",
            "Prompt tokens the backend reported, for answers that reported cached tokens",
            ["backend"],
            registry=r,
        )
        self.route_index_corrections = Counter(
            "sluice_route_index_corrections",
            "Times a backend's reported hit showed an eviction and the index was corrected",
            registry=r,
        )
        self.route_index_blocks = Gauge(
            "sluice_route_index_blocks", "(backend, block) entries in the prefix index", registry=r
        )
        self.admission_rejected = Counter(
            "sluice_admission_rejected",
            "Requests refused with 429, by reason (tokens_per_minute, request_too_large, "
            "queue_full, key_queue_full, queue_timeout)",
            ["reason"],
            registry=r,
        )
        self.admission_waiting = Gauge(
            "sluice_admission_waiting",
            "Requests held at the proxy while every engine of their pool is saturated",
            registry=r,
        )
        self.admission_held = LabelledReading(
            "sluice_admission_held", "Requests held now, by model", "model", registry=r
        )
        self.backend_saturated = LabelledReading(
            "sluice_backend_saturated",
            "1 while the proxy judges a backend's engine saturated (it holds requests back)",
            "backend",
            registry=r,
        )
        self.backend_room = LabelledReading(
            "sluice_backend_room",
            "Sequences its engine runs at once, as the proxy judges it, and on what basis "
            "(stated by the engine, seen-full: it refused to run more, unknown: +Inf, nothing "
            "is held for it)",
            ("backend", "basis"),
            registry=r,
        )
        self.backend_queued = LabelledReading(
            "sluice_backend_queued",
            "The proxy's requests that may be waiting in the backend's own engine queue",
            "backend",
            registry=r,
        )
        self.admission_held_with_room = held_with_room = Counter(
            "sluice_admission_held_with_room_seconds",
            "Seconds requests were held at the proxy while this backend's engine reported "
            "room (free sequences, an empty queue, after the proxy's last change): kept at 0",
            ["backend"],
            registry=r,
        )
        admission_wait = Histogram(
            "sluice_admission_wait_seconds",
            "Time a held request waited for an engine with room, by model",
            ["model"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        admission_dispatched = Counter(
            "sluice_admission_dispatched",
            "Requests that passed the gate to a backend, by model and API key (its label)",
            ["model", "api_key"],
            registry=r,
        )
        admission_shed = Counter(
            "sluice_admission_shed",
            "Requests refused at the gate, by model and reason "
            "(queue_full, key_queue_full, queue_timeout, tokens_per_minute, request_too_large)",
            ["model", "reason"],
            registry=r,
        )
        self.admission = AdmissionStats(
            lambda model, waited: admission_wait.labels(model).observe(waited),
            lambda model, key: admission_dispatched.labels(model, key).inc(),
            lambda model, reason: admission_shed.labels(model, reason).inc(),
            clock,
            lambda url, seconds: held_with_room.labels(url).inc(seconds),
        )

    def forget_backend(self, url: str) -> None:
        """A backend left the pool: drop its per-backend series (requests_total stays)."""
        self.admission.forget(url)
        for metric in (
            self.backend_healthy,
            self.admission_held_with_room,
            self.route_predicted_tokens,
            self.route_reported_cached_tokens,
            self.route_reported_prompt_tokens,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(url)

    def render(self) -> bytes:
        return generate_latest(self.registry)
