"""Backend state: health, in-flight load and a circuit breaker. Pure: the caller passes `now`.

A backend takes traffic when its last active health check passed and its breaker is not
open. The breaker opens after `failures_to_open` consecutive failed requests and stays open
for `cooldown` seconds; then it is half-open: traffic flows again, and the next failure
opens it at once while the next success closes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Backend:
    url: str
    healthy: bool = False
    inflight: int = 0
    consecutive_failures: int = 0
    open_until: float = 0.0
    half_open: bool = False
    probe_path: str = "/health"
    models: list[dict[str, Any]] = field(default_factory=list)
    last_error: str | None = None

    @property
    def max_model_len(self) -> int | None:
        for model in self.models:
            value = model.get("max_model_len")
            if isinstance(value, int) and value > 0:
                return value
        return None

    def takes_traffic(self, now: float) -> bool:
        return self.healthy and now >= self.open_until


class BackendPool:
    def __init__(
        self, urls: tuple[str, ...], *, failures_to_open: int, cooldown: float, probe_path: str
    ) -> None:
        if not urls:
            raise ValueError("at least one backend URL is needed")
        self.backends = [Backend(url.rstrip("/"), probe_path=probe_path) for url in urls]
        self.failures_to_open = failures_to_open
        self.cooldown = cooldown

    def available(self, now: float, exclude: tuple[Backend, ...] = ()) -> list[Backend]:
        return [b for b in self.backends if b.takes_traffic(now) and b not in exclude]

    def any_available(self, now: float) -> bool:
        return any(b.takes_traffic(now) for b in self.backends)

    def request_succeeded(self, backend: Backend) -> None:
        backend.consecutive_failures = 0
        backend.half_open = False
        backend.last_error = None

    def request_failed(self, backend: Backend, now: float, error: str) -> None:
        backend.consecutive_failures += 1
        backend.last_error = error
        if backend.half_open or backend.consecutive_failures >= self.failures_to_open:
            backend.open_until = now + self.cooldown
            backend.half_open = True

    def health_checked(self, backend: Backend, ok: bool, error: str | None = None) -> None:
        backend.healthy = ok
        if not ok:
            backend.last_error = error

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        return [
            {
                "url": b.url,
                "healthy": b.healthy,
                "takes_traffic": b.takes_traffic(now),
                "breaker": "open"
                if now < b.open_until
                else "half-open"
                if b.half_open
                else "closed",
                "inflight": b.inflight,
                "consecutive_failures": b.consecutive_failures,
                "probe_path": b.probe_path,
                "models": [m.get("id") for m in b.models],
                "max_model_len": b.max_model_len,
                "last_error": b.last_error,
            }
            for b in self.backends
        ]
