"""The proxy's own metrics: disaggregated serving's two hops (two_hops.py).

Every request of a disaggregated model is counted once, by how it was served at the end:
`mode` disaggregated (two hops), or aggregated with the reason it took one (a short prompt,
n > 1, a saturated or failed prefill, an engine that named no transfer: app/routing/
disaggregation.py's rule 2).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from app.observe.metrics import Counter, Histogram

# The hand-off's target is p50 <= 1 ms, p99 <= 3 ms: buckets on both sides of each.
HANDOFF_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.05)
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class PdMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "sluice_pd_requests",
            "Requests of disaggregated models, by how they were served (disaggregated, or "
            "aggregated and why)",
            ["model", "mode", "reason"],
            registry=registry,
        )
        self.handoff_seconds = Histogram(
            "sluice_pd_handoff_seconds",
            "The proxy's own time from a prefill leg's answer to its decode leg's request",
            buckets=HANDOFF_BUCKETS,
            registry=registry,
        )
        self.prefill_seconds = Histogram(
            "sluice_pd_prefill_seconds",
            "Prefill legs, from their request to their whole answer",
            buckets=PREFILL_BUCKETS,
            registry=registry,
        )
        self.leg_failures = Counter(
            "sluice_pd_leg_failures",
            "Legs of disaggregated requests that failed before answering, by leg",
            ["leg"],
            registry=registry,
        )
