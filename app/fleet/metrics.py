"""The backends' own metrics, as the health checks find them."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry

from app.observe.metrics import Declare


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.backend_healthy = Declare(registry).gauge(
            "sluice_backend_healthy", "1 if the backend takes traffic", ["backend"]
        )

    def forget_backend(self, url: str) -> None:
        """A backend left the pool: drop its health series."""
        with contextlib.suppress(KeyError):
            self.backend_healthy.remove(url)
