"""The fleet's own metrics: the backends' health as the checks find it, discovery's changes
as the sources see them, and the LoRA adapters loaded and unloaded on them
(adapter_loader.py)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry

from app.observe.metrics import Declare


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        declare = Declare(registry)
        self.backend_healthy = declare.gauge(
            "sluice_backend_healthy", "1 if the backend takes traffic", ["backend"]
        )
        self.discovery_changes = declare.counter(
            "sluice_discovery_changes",
            "Backends a discovery source added (joined) or took away (left: drained), by source "
            "(static, api, dns:NAME:PORT, k8s:NAMESPACE/SELECTOR)",
            ["source", "change"],
        )
        self.discovery_lookups = declare.counter(
            "sluice_discovery_lookups",
            "Lookups (DNS answers, Kubernetes lists and watch events) by source and outcome "
            "(ok, failed: what was seen before stands)",
            ["source", "outcome"],
        )
        self.discovery_endpoints = declare.reading(
            "sluice_discovery_endpoints", "Engines each discovery source sees now", ["source"]
        )
        self.drains = declare.counter(
            "sluice_backend_drains",
            "Backends that left the pool, by how their drain ended: finished (every request "
            "in flight ended) or timed_out (--drain-timeout passed first)",
            ["outcome"],
        )
        self.draining = declare.gauge(
            "sluice_backends_draining", "Backends out of the pool whose requests still run"
        )
        self.lora_loads = declare.counter(
            "sluice_lora_loads",
            "LoRA adapter loads asked of an engine on demand, by outcome (loaded, failed)",
            ["backend", "outcome"],
        )
        self.lora_unloads = declare.counter(
            "sluice_lora_unloads",
            "LoRA adapters unloaded to make room for another, by outcome (unloaded, failed)",
            ["backend", "outcome"],
        )

    def forget_backend(self, url: str) -> None:
        """A backend left the pool: drop its health series."""
        with contextlib.suppress(KeyError):
            self.backend_healthy.remove(url)
