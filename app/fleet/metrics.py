"""The backends' own metrics, as the health checks find them, and the LoRA adapters loaded
and unloaded on them (adapter_loader.py)."""

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
