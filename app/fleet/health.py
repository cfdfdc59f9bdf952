"""Active health checks: probe every backend every few seconds, concurrently.

Every `interval` while requests are sent; after a check that saw none sent since the one
before, every `IDLE_INTERVALS` intervals, and at the normal pace again from the next request
on (a request that finds a backend dead meanwhile is retried on another and opens its
breaker). Probes go through the watchers' own lean client (app/http/fetch.py): with httpx
each cost the loop ~1-2.5 ms, and 4 backends every 3 s were half an idle proxy's CPU.

A backend that answers 404 on the health path (some OpenAI-compatible servers have no
/health) is probed on /v1/models from then on and is never ejected for the 404 itself.
The model list (with `max_model_len`) is read from /v1/models when a backend turns healthy
and every `MODELS_REFRESH_S` while it stays so (served names change when an adapter is
loaded, seldom): each read costs the loop ~1 ms, a probe as much again.
With `--forward tokens`, a healthy backend due a tokenizer check (after re-admission, or after
a check that could not finish) gets one right after its health probe (tokenizer_check.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import trio

from app.errors import UpstreamError
from app.fleet.backends import Backend
from app.fleet.metrics import FleetMetrics
from app.fleet.pool import BackendPool
from app.fleet.tokenizer_check import check_tokenizer
from app.fleet.traffic import NO_TRAFFIC, TrafficSource
from app.http.fetch import Fetched, Fetcher

log = logging.getLogger("sluice.health")

MODELS_PATH = "/v1/models"
MODELS_REFRESH_S = 30.0
IDLE_INTERVALS = 4
# Probes in flight at once. Answers that come together wake their tasks together, and the
# loop runs them all before anything else: at 64 refused connects a batch was ~114 steps,
# 10-15 ms late for everything else; at 16 it is a quarter of that. A round of 1,000
# engines answering in ~2 ms takes ~0.1 s; engines that time out hold a prober each.
PROBES_AT_ONCE = 16


@dataclass(eq=False)
class HealthChecker:
    """`traffic` paces it: every `interval` while requests are sent, slower when none are."""

    pool: BackendPool
    client: Fetcher
    metrics: FleetMetrics
    _: KW_ONLY
    interval: float
    timeout: float
    traffic: TrafficSource = NO_TRAFFIC
    # Backend id -> when its models were read.
    _models_read_at: dict[str, float] = field(default_factory=dict, init=False)
    _probes: trio.CapacityLimiter = field(
        default_factory=lambda: trio.CapacityLimiter(PROBES_AT_ONCE), init=False
    )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check once so the proxy starts with a true picture, then keep checking."""
        await self.check_all()
        task_status.started()
        seen = self.traffic.requests
        while True:
            checked_at = trio.current_time()
            if self.traffic.requests == seen:
                with trio.move_on_after(self.interval * IDLE_INTERVALS):
                    await self.traffic.next_request()
            await trio.sleep_until(checked_at + self.interval)
            seen = self.traffic.requests
            await self.check_all()

    async def check_all(self) -> None:
        current = {backend.id for backend in self.pool.backends}
        for gone in self._models_read_at.keys() - current:
            del self._models_read_at[gone]
        backends = iter(list(self.pool.backends))
        async with trio.open_nursery() as nursery:
            for _ in range(PROBES_AT_ONCE):  # probers taking the next backend as each ends
                nursery.start_soon(self._check_each, backends)

    async def _check_each(self, backends: Iterator[Backend]) -> None:
        for backend in backends:
            await self.check(backend)

    async def check(self, backend: Backend) -> None:
        was_healthy = backend.healthy
        async with self._probes:
            ok, error = await self._probe(backend)
        read_at = self._models_read_at.get(backend.id)
        due = read_at is None or trio.current_time() - read_at >= MODELS_REFRESH_S
        if ok and backend.probe_path != MODELS_PATH and (due or not was_healthy):
            await self._refresh_models(backend)
        if backend not in self.pool.backends:
            return  # removed while it was being probed
        self.pool.health_checked(backend, ok, error)
        self.metrics.backend_healthy.labels(backend=backend.url).set(1 if ok else 0)
        if ok != was_healthy:
            log.info(
                "backend %s is %s%s",
                backend.url,
                "healthy" if ok else "unhealthy",
                f" ({error})" if error else "",
            )
        if ok:
            await check_tokenizer(self.pool, backend, self.client, self.timeout)

    async def _probe(self, backend: Backend) -> tuple[bool, str | None]:
        try:
            with trio.fail_after(self.timeout):
                response = await self.client.get(backend.url, backend.probe_path)
                if response.status == 404 and backend.probe_path != MODELS_PATH:
                    log.info(
                        "backend %s has no %s; probing %s instead",
                        backend.url,
                        backend.probe_path,
                        MODELS_PATH,
                    )
                    backend.probe_path = MODELS_PATH
                    response = await self.client.get(backend.url, MODELS_PATH)
        except trio.TooSlowError:
            return False, f"health check timed out after {self.timeout:g}s"
        except UpstreamError as exc:
            return False, f"health check failed: {exc}"
        if response.status != 200:
            return False, f"health check answered {response.status}"
        if backend.probe_path == MODELS_PATH:
            _store_models(backend, response)
            self._models_read_at[backend.id] = trio.current_time()
        return True, None

    async def _refresh_models(self, backend: Backend) -> None:
        try:
            with trio.fail_after(self.timeout):
                response = await self.client.get(backend.url, MODELS_PATH)
        except (trio.TooSlowError, UpstreamError):
            return
        if response.status == 200:
            _store_models(backend, response)
            self._models_read_at[backend.id] = trio.current_time()


def _store_models(backend: Backend, response: Fetched) -> None:
    try:
        payload: Any = response.json()
    except ValueError:
        return
    data = payload.get("data") if isinstance(payload, dict) else None
    if isinstance(data, list):
        cards = [
            m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]
        ]
        backend.set_models(cards)
        backend.adapters.listed(cards)
