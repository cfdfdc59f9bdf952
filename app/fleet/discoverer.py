"""Discovery at run time: the sources run, each whole set one publishes changes the pool
(through the router, which forgets what it knew of a backend that leaves), a backend that
joins is health-checked at once, and one that leaves drains.

A source is any object with a `name` and an async `run(report)` that never returns: it
looks (resolves a name, lists and watches pods) and calls `report.sighting(endpoints)` with
the whole set each time it knows it, or `report.failed(why)` when it could not look (what it
saw last then stands: app/fleet/discovery.py). Sources handle their own schedules, back-off
and reconnects; an exception out of one is a bug, logged, and that source restarts after
`RESTART_S` rather than taking the proxy down.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from app.config import BackendRole
from app.fleet.backends import Backend
from app.fleet.discovery import API_SOURCE, STATIC_SOURCE, Changes, Endpoint, Membership
from app.fleet.metrics import FleetMetrics
from app.fleet.pool import BackendPool

log = logging.getLogger("sluice.discovery")

RESTART_S = 5.0
# How often draining backends are looked at: a drain ends within this of its last request.
DRAIN_POLL_S = 0.1


class FleetChanges(Protocol):
    """What discovery changes (the router: it also forgets a leaving backend's index)."""

    @property
    def pool(self) -> BackendPool: ...

    def add_backend(
        self,
        url: str,
        role: BackendRole | None = None,
        models: tuple[str, ...] | None = None,
        source: str = API_SOURCE,
    ) -> Backend: ...

    def drain_backend(self, backend: Backend, timeout: float) -> None: ...

    def backend_drained(self, backend: Backend) -> None: ...


@dataclass
class SourceStatus:
    """What the dashboard shows of a source."""

    name: str
    endpoints: int = 0
    sightings: int = 0
    failures: int = 0  # in a row, since its last sighting
    last_sighting_at: float | None = None  # trio's clock
    last_error: str | None = None


class SourceReport:
    """How a source tells what it sees (`sighting`) or that it could not look (`failed`)."""

    def __init__(self, discoverer: Discoverer, status: SourceStatus) -> None:
        self._discoverer = discoverer
        self.status = status

    def sighting(self, endpoints: Iterable[Endpoint]) -> None:
        self._discoverer.sighted(self.status, endpoints)

    def failed(self, error: str) -> None:
        status = self.status
        status.failures += 1
        status.last_error = error
        self._discoverer.metrics.discovery_lookups.labels(status.name, "failed").inc()
        if status.failures == 1:
            log.warning("discovery %s: %s (what it saw before stands)", status.name, error)


class Source(Protocol):
    name: str

    async def run(self, report: SourceReport) -> None: ...


class Discoverer:
    """The pool's membership at run time: sources, the admin API and drains."""

    def __init__(
        self,
        fleet: FleetChanges,
        check: Callable[[Backend], Awaitable[None]],
        metrics: FleetMetrics,
        drain_timeout: float,
    ) -> None:
        self.fleet = fleet
        self.check = check
        self.metrics = metrics
        self.drain_timeout = drain_timeout
        self.membership = Membership()
        self.statuses: list[SourceStatus] = []
        self._nursery: trio.Nursery | None = None
        self._drain_started = trio.Event()
        static = [Endpoint(b.url, b.role, b.bootstrap_port) for b in fleet.pool.backends]
        self.membership.sighted(STATIC_SOURCE, static)
        metrics.discovery_endpoints.set_function(lambda: self.membership.counts().items())
        metrics.draining.set_function(lambda: len(fleet.pool.draining))

    async def run(
        self,
        sources: Sequence[Source],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for source in sources:
                status = SourceStatus(source.name)
                self.statuses.append(status)
                nursery.start_soon(self._keep_running, source, SourceReport(self, status))
            task_status.started()
            await self._finish_drains()

    def sighted(self, status: SourceStatus, endpoints: Iterable[Endpoint]) -> None:
        found = tuple(endpoints)
        status.endpoints, status.failures = len(found), 0
        status.sightings += 1
        status.last_sighting_at = trio.current_time()
        self.metrics.discovery_lookups.labels(status.name, "ok").inc()
        self._apply(self.membership.sighted(status.name, found))

    def added(self, backend: Backend) -> None:
        """The admin API added `backend`."""
        endpoint = Endpoint(backend.url, backend.role, backend.bootstrap_port)
        known = self.membership.seen.get(API_SOURCE, {}).values()
        self.membership.sighted(API_SOURCE, [*known, endpoint])
        self.metrics.discovery_changes.labels(API_SOURCE, "joined").inc()

    def remove(self, backend: Backend) -> None:
        """The admin API removed `backend`: it drains, whichever source found it."""
        self.membership.forget(backend.url)
        self._drain(backend)

    def _apply(self, changes: Changes) -> None:
        for url in changes.leaves:
            backend = self.fleet.pool.find(url)
            if backend is not None:
                self._drain(backend)
        for endpoint, source in changes.joins:
            role = None
            if endpoint.role != "both" or endpoint.bootstrap_port is not None:
                role = BackendRole(endpoint.url, endpoint.role, endpoint.bootstrap_port)
            try:
                backend = self.fleet.add_backend(endpoint.url, role, endpoint.models, source)
            except ValueError:
                continue  # in the pool already (a static backend a source names too)
            log.info("discovery %s: %s joins", source, endpoint.url)
            self.metrics.discovery_changes.labels(source, "joined").inc()
            if self._nursery is not None:
                self._nursery.start_soon(self.check, backend)

    def _drain(self, backend: Backend) -> None:
        log.info(
            "%s leaves (%s): draining %d in flight", backend.url, backend.source, backend.inflight
        )
        self.fleet.drain_backend(backend, self.drain_timeout)
        self.metrics.discovery_changes.labels(backend.source, "left").inc()
        self._drain_started.set()

    async def _finish_drains(self) -> None:
        pool = self.fleet.pool
        while True:
            if not pool.draining:
                await self._drain_started.wait()
                self._drain_started = trio.Event()
            await trio.sleep(DRAIN_POLL_S)
            for drained in pool.drained(trio.current_time()):
                outcome = "finished" if drained.backend.inflight <= 0 else "timed_out"
                self.metrics.drains.labels(outcome).inc()
                if outcome == "timed_out":
                    log.warning(
                        "%s: --drain-timeout passed with %d requests in flight; forgotten",
                        drained.backend.url,
                        drained.backend.inflight,
                    )
                self.fleet.backend_drained(drained.backend)

    async def _keep_running(self, source: Source, report: SourceReport) -> None:
        while True:
            try:
                await source.run(report)
            except Exception as exc:  # a source's bug must not take the proxy down
                log.exception("discovery %s failed; restarting it in %gs", source.name, RESTART_S)
                report.failed(f"{type(exc).__name__}: {exc}")
            await trio.sleep(RESTART_S)
