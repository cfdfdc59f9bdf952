"""The metrics of routing, and those both doors (the proxy, the endpoint picker) count alike.

`DoorMetrics` are declared here, below both doors, because each door counts its decisions,
its own time and its backends' answers the same way. `RoutingMetrics` are the router's: the
gate's admission (`AdmissionMetrics`), cache_aware's predictions checked against what the
backends report, and the per-backend readings taken from the pool at each scrape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import trio
from prometheus_client import CollectorRegistry

from app.fleet.metrics import FleetMetrics
from app.observe.admission_stats import WAIT_BUCKETS, AdmissionStats
from app.observe.metrics import Declare
from app.observe.saturation_signal import SaturationCollector

# The decision alone: tens of microseconds to a few milliseconds.
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class DoorMetrics:
    """What a door counts of each request it routes: the decision, the time the door added
    before the backend had it, the backend's answer, and each door's own."""

    def __init__(self, registry: CollectorRegistry) -> None:
        declare = Declare(registry)
        self.backend_requests = declare.counter(
            "sluice_backend_requests",
            "Requests forwarded, by backend and HTTP status (0: no response)",
            ["backend", "code"],
        )
        self.route_decisions = declare.counter(
            "sluice_route_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
        )
        self.proxy_overhead_seconds = declare.histogram(
            "sluice_proxy_overhead_seconds",
            "Time the proxy adds before the request is handed to a backend",
            buckets=OVERHEAD_BUCKETS,
        )
        self.epp_decision_seconds = declare.histogram(
            "sluice_epp_decision_seconds",
            "The endpoint picker's own time for a request: its body's last byte in to its "
            "endpoints out, less rendering, tokenizing and the time it was held for room",
            buckets=DECISION_BUCKETS,
        )
        self.untidy_streams = declare.counter(
            "sluice_untidy_streams",
            "Streams cut after their engine had finished them (ended cleanly all the same)",
            ["endpoint"],
        )


class AdmissionMetrics:
    """The gate's: requests held, let through and refused, and time held while an engine
    had room."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float]) -> None:
        """`clock`: the loop's, for what is counted by the second (admission's window)."""
        declare = Declare(registry)
        self.admission_rejected = declare.counter(
            "sluice_admission_rejected",
            "Requests refused with 429, by reason (tokens_per_minute, request_too_large, "
            "queue_full, key_queue_full, queue_timeout)",
            ["reason"],
        )
        self.admission_waiting = declare.gauge(
            "sluice_admission_waiting",
            "Requests held at the proxy while every engine of their pool is saturated",
        )
        self.admission_held = declare.reading(
            "sluice_admission_held", "Requests held now, by model", ["model"]
        )
        # What an autoscaler scales on, and its parts (app/observe/saturation_signal.py).
        self.saturation_signal = SaturationCollector(registry)
        self.admission_held_with_room = held_with_room = declare.counter(
            "sluice_admission_held_with_room_seconds",
            "Seconds requests were held at the proxy while this backend's engine reported "
            "room (free sequences, an empty queue, after the proxy's last change): kept at 0",
            ["backend"],
        )
        admission_wait = declare.histogram(
            "sluice_admission_wait_seconds",
            "Time a held request waited for an engine with room, by model",
            ["model"],
            buckets=WAIT_BUCKETS,
        )
        admission_dispatched = declare.counter(
            "sluice_admission_dispatched",
            "Requests that passed the gate to a backend, by model and API key (its label)",
            ["model", "api_key"],
        )
        admission_shed = declare.counter(
            "sluice_admission_shed",
            "Requests refused at the gate, by model and reason "
            "(queue_full, key_queue_full, queue_timeout, tokens_per_minute, request_too_large)",
            ["model", "reason"],
        )
        self.admission = AdmissionStats(
            lambda model, waited: admission_wait.labels(model).observe(waited),
            lambda model, key: admission_dispatched.labels(model, key).inc(),
            lambda model, reason: admission_shed.labels(model, reason).inc(),
            clock,
            lambda url, seconds: held_with_room.labels(url).inc(seconds),
        )


class RoutingMetrics(AdmissionMetrics):
    def __init__(
        self,
        registry: CollectorRegistry,
        fleet: FleetMetrics,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        """`fleet`: the backends' own series, dropped with a backend's (`forget_backend`)."""
        super().__init__(registry, clock)
        self.fleet = fleet
        declare = Declare(registry)
        self.backend_inflight = declare.reading(
            "sluice_backend_inflight_requests", "Requests in flight", ["backend"]
        )
        self.backend_saturated = declare.reading(
            "sluice_backend_saturated",
            "1 while the proxy judges a backend's engine saturated (it holds requests back)",
            ["backend"],
        )
        self.backend_room = declare.reading(
            "sluice_backend_room",
            "Sequences its engine runs at once, as the proxy judges it, and on what basis "
            "(stated by the engine, seen-full: it refused to run more, unknown: +Inf, nothing "
            "is held for it)",
            ["backend", "basis"],
        )
        self.backend_queued = declare.reading(
            "sluice_backend_queued",
            "The proxy's requests that may be waiting in the backend's own engine queue",
            ["backend"],
        )
        self.route_predictions = declare.counter(
            "sluice_route_predictions",
            "cache_aware predictions by outcome against the backend's reported cached tokens "
            "(hit, miss, false-hit, surprise-hit, unreported)",
            ["outcome"],
        )
        self.route_predicted_tokens = declare.counter(
            "sluice_route_predicted_cached_tokens",
            "Prompt tokens cache_aware predicted the backend had in its prefix cache",
            ["backend"],
        )
        self.route_reported_cached_tokens = declare.counter(
            "sluice_route_reported_cached_tokens",
            "Prompt tokens the backend reported served from its prefix cache",
            ["backend"],
        )
        self.route_reported_prompt_tokens = declare.counter(
            "sluice_route_reported_prompt_tokens",
            "Prompt tokens the backend reported, for answers that reported cached tokens",
            ["backend"],
        )
        self.route_index_corrections = declare.counter(
            "sluice_route_index_corrections",
            "Times a backend's reported hit showed an eviction and the index was corrected",
        )
        self.route_index_blocks = declare.gauge(
            "sluice_route_index_blocks",
            "(backend, block) entries in the prefix index",
        )
        self.lora_routes = declare.counter(
            "sluice_lora_routes",
            "Requests for a LoRA adapter routed, by the best affinity tier among the engines "
            "with room (resident, free-slot, queued, none)",
            ["tier"],
        )

    def forget_backend(self, url: str) -> None:
        """A backend left the pool: drop its per-backend series (requests_total stays)."""
        self.admission.forget(url)
        self.fleet.forget_backend(url)
        for metric in (
            self.admission_held_with_room,
            self.route_predicted_tokens,
            self.route_reported_cached_tokens,
            self.route_reported_prompt_tokens,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(url)
