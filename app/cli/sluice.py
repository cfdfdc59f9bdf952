"""One Sluice process wired: the proxy server, its dashboard, and what watches and feeds them
(stall monitor, health checks, load scrapes, KV-event subscribers, budget sync), in one
nursery. `sluice serve` runs one (serve.py), each worker of `--workers N` runs one
(worker.py), and `sluice demo` runs one beside its simulated GPUs (demo.py).
"""

from __future__ import annotations

import gc
import logging
import signal
import time
from collections.abc import Callable

import trio

from app.budgets.shared import SharedBudgets, SharedBudgetsSnapshot
from app.budgets.sync import BudgetCollector, BudgetSync, RedisBudgetsSnapshot
from app.cli.discovery_sources import discovery_sources
from app.cli.rooms import (
    RoomMetrics,
    backend_roles,
    dashboard_server,
    disaggregation_settings,
    preprocess_settings,
    proxy_settings,
    router_settings,
)
from app.config import Saturation, Settings
from app.dashboard.app import DashboardSources
from app.dashboard.backends_api import BackendControl
from app.dashboard.feed import DashboardFeed
from app.dashboard.model_rows import CACHE_COUNTERS, model_rows
from app.dashboard.serving import serve_dashboard
from app.dashboard.snapshot import Snapshot, backend_view, shown_backends
from app.epp.door import EppDoor
from app.epp.processor import EndpointPicker
from app.fleet.adapter_loader import AdapterLoader
from app.fleet.catalog import ModelCatalog, configured_backends
from app.fleet.discoverer import Discoverer
from app.fleet.health import HealthChecker
from app.fleet.load_scraper import LoadScraper
from app.fleet.pool import BackendPool
from app.fleet.saturation import queued_ours
from app.fleet.tokenizer_check import check_tokenizers_at_startup
from app.http.client import UpstreamPool
from app.http.fetch import Fetcher
from app.http.relay_hub import RelayHub
from app.http.server import HttpServer
from app.kv_events.subscriber import KvEventsSnapshot, subscribers_for
from app.models import NO_MODEL
from app.observe.access_log import AccessLog
from app.observe.backend_stats import backend_traffic
from app.observe.export_metrics import ExportCollector
from app.observe.kv_event_metrics import KvEventCollector
from app.observe.loop_monitor import LoopMonitor
from app.observe.metric_summaries import counts_by_label, counts_by_two_labels, tokenize_summary
from app.observe.metrics import exposition_in_slices
from app.observe.tracing import Tracer
from app.observe.worker_metrics import WorkerInfo
from app.preprocess.model_preps import check_one_tokenizer
from app.preprocess.pipeline import Preprocessor
from app.preprocess.reception import Reception
from app.preprocess.tokenizer_loading import TokenizerLike
from app.proxy.app import ProxyApp
from app.proxy.to_backend import Forwarder
from app.proxy.two_hops import TwoHops
from app.routing.decider import Decider
from app.routing.disaggregation import Disaggregation
from app.routing.router import Router

log = logging.getLogger("sluice")


class Sluice:
    """The proxy, its dashboard and its watchers, ready to run in a nursery."""

    def __init__(
        self,
        settings: Settings,
        *,
        tokenizer: TokenizerLike | None = None,
        server_factory: Callable[[ProxyApp], HttpServer] = HttpServer,
        worker: int | None = None,
    ) -> None:
        """`tokenizer` replaces the one `settings` names (tests inject slow or gated ones);
        `server_factory` and `worker`: how a worker of `--workers N` listens, and which."""
        self.settings = settings
        self.server_factory = server_factory
        self.worker = worker
        self.metrics = RoomMetrics.create()
        if worker is not None:
            self.metrics.registry.register(WorkerInfo(worker))
        self.pool = BackendPool(
            settings.all_backends,
            failures_to_open=settings.breaker_failures,
            cooldown=settings.breaker_cooldown,
            probe_path=settings.health_check_path,
            configured=configured_backends(settings.models),
            roles=backend_roles(settings),
        )
        loadable = settings.adapters if settings.lora_load_on_demand else ()
        self.catalog = ModelCatalog(settings.models, settings.max_model_len, loadable)
        self.router = Router(router_settings(settings), self.pool, self.metrics.routing)
        # Made once running: it loads through the watchers' client.
        self.adapter_loader: AdapterLoader | None = None
        self.decider = Decider(self.router, self.pool)
        self.policy = self.router.policy
        self.budget_sync: BudgetSync | None = None
        if isinstance(self.router.buckets, SharedBudgets) and settings.redis_url:
            self.budget_sync = BudgetSync(self.router.buckets, settings.redis_url)
            self.metrics.registry.register(BudgetCollector(self.budget_sync))
        self.kv_subscribers = subscribers_for(
            settings.kv_event_endpoints(), settings.max_index_blocks, self.pool, self.policy
        )
        self.router.kv_events = {url: s.events for url, s in self.kv_subscribers.items()}
        self.metrics.registry.register(KvEventCollector(self.kv_event_snapshots))
        self.tracer = Tracer(settings.otlp_endpoint)
        self.access_log = AccessLog() if settings.access_log == "json" else None
        self.metrics.registry.register(
            ExportCollector(
                self.tracer.counters if self.tracer.enabled else None,
                self.access_log.counters if self.access_log is not None else None,
            )
        )
        self.discoverer: Discoverer | None = None  # set once running
        self.monitor = LoopMonitor(
            self.metrics.loop, settings.stall_threshold_ms, settings.stall_instrument
        )
        preprocess = preprocess_settings(settings)
        self.preprocessor = Preprocessor(
            preprocess, self.metrics.preprocess, tokenizer=tokenizer, phase=self.monitor.phase
        )
        if settings.forward == "tokens":
            check_one_tokenizer(self.preprocessor.preps)
        self.reception = Reception(
            preprocess,
            self.preprocessor,
            self.catalog,
            self.pool,
            self.metrics.preprocess,
            self.metrics.traffic,
            self.tracer,
            self.access_log,
        )
        self.shutdown = trio.Event()
        # `sluice demo` sets this: the dashboard's "send a burst" button calls it.
        self.request_burst: Callable[[], bool] | None = None
        self.dashboard_feed: DashboardFeed | None = None  # once running
        self.epp_port: int | None = None  # the endpoint picker's, once it listens

    def set_saturation(self, policy: Saturation) -> None:
        log.info("saturation policy is now %s", policy)
        self.preprocessor.saturation = policy

    async def snapshot(self) -> Snapshot:
        """What the dashboard shows, built in stages with the loop's other work between them:
        each stage that reads every backend costs ~2-4 ms at 1,000 backends, ~12 ms in all."""
        now = trio.current_time()
        traffic = self.metrics.traffic
        members = self.pool.members
        shown = shown_backends(members, [d.backend for d in self.pool.draining])
        rows = self.pool.snapshot(now, shown)
        await trio.lowlevel.checkpoint()
        metrics = self.metrics
        codes = counts_by_two_labels(metrics.doors.backend_requests, "backend", "code")
        answered = traffic.backends.snapshot(time.perf_counter())
        requests = traffic.snapshot()
        preps = self.preprocessor.preps
        models = model_rows(
            self.catalog.directory(self.pool.backends),
            self.pool.members_summary(now) if len(shown) < len(members) else rows,
            preps.describe(),
            preps.default.describe(),
            counts_by_two_labels(metrics.preprocess.requests, "model", "code"),
            {
                name: counts_by_label(getattr(metrics.preprocess, name), "model")
                for name in CACHE_COUNTERS
            },
            requests["recent"],
            counts_by_two_labels(metrics.pd.requests, "model", "reason"),
            counts_by_label(metrics.pd.leg_failures, "leg"),
        )
        await trio.lowlevel.checkpoint()
        kv_events = self.kv_event_snapshots()
        gate = self.router.gate
        held_with_room = self.metrics.routing.admission.held_with_room_s
        backends = [
            backend_view(
                row,
                backend_traffic(backend.url, codes, answered),
                kv_events.get(backend.url),
                gate.saturated(backend),
                queued_ours(backend, now),
                held_with_room.get(backend.url, 0.0),
                backend.adapters.snapshot(),
            )
            for row, backend in zip(rows, shown, strict=True)
        ]
        await trio.lowlevel.checkpoint()
        routing = self.router.snapshot()
        await trio.lowlevel.checkpoint()
        signals = gate.signals()
        await trio.lowlevel.checkpoint()
        held = {model or NO_MODEL: len(queue) for model, queue in gate.queues.items()}
        snapshot: Snapshot = {
            "time": now,
            "wall_time": time.time(),
            "policy": self.policy.name,
            "models": models,
            "backends": backends,
            "backends_total": len(members),
            "routing": routing,
            "preprocess": self.preprocessor.snapshot(),
            "loop": self.monitor.snapshot(),
            "tokenize": tokenize_summary(self.metrics.preprocess),
            "requests": requests,
            "admission": self.metrics.routing.admission.snapshot(held, now, signals),
            "budgets": self.budgets_snapshot(),
            "notices": self.budget_sync.notices() if self.budget_sync else [],
        }
        if self.discoverer is not None and self.discoverer.statuses:
            snapshot["discovery"] = self.discoverer.snapshot(now)
        return snapshot

    def budgets_snapshot(self) -> RedisBudgetsSnapshot | SharedBudgetsSnapshot | None:
        if self.budget_sync is not None:
            return self.budget_sync.snapshot()
        buckets = self.router.buckets
        return buckets.snapshot(trio.current_time()) if isinstance(buckets, SharedBudgets) else None

    async def metrics_text(self) -> bytes:
        return await exposition_in_slices(self.metrics.registry)

    def kv_event_snapshots(self) -> dict[str, KvEventsSnapshot]:
        now = trio.current_time()
        return {url: s.snapshot(now) for url, s in self.kv_subscribers.items()}

    def occupancy(self) -> dict[str, float]:
        """The tokenizer's busiest moments since the last call, which the dashboard reads once
        a tick: short bursts between two ticks still show."""
        peaks = self.preprocessor.tokenizer_peaks()
        return {
            "threads_busy": peaks["busy"],
            "queued": peaks["queued"],
            "saturated_waiting": peaks["saturated_waiting"],
            "fallback_busy": peaks["fallback_busy"],
        }

    async def run(
        self, *, task_status: trio.TaskStatus[tuple[str, str]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until `shutdown` is set; report (proxy URL, dashboard URL) once listening."""
        settings = self.settings
        client = Fetcher(connect_timeout=settings.health_check_timeout)
        async with self.preprocessor.running(), trio.open_nursery() as nursery:
            discoverer = await self._start_watchers(nursery, client)
            upstream = UpstreamPool(
                connect_timeout=settings.connect_timeout,
                first_byte_timeout=settings.first_byte_timeout,
                max_connections=settings.max_connections,
            )
            proxy = await self._start_proxy(nursery, upstream)
            # Tokens mode: no backend takes traffic before its tokenizer was compared, so
            # compare before listening.
            await check_tokenizers_at_startup(self.pool, settings.health_check_timeout)
            await self._serve(proxy, discoverer, task_status)
            await upstream.aclose()
            await client.aclose()
            nursery.cancel_scope.cancel()

    async def _start_watchers(self, nursery: trio.Nursery, client: Fetcher) -> Discoverer:
        """The stall monitor, health checks, discovery, the router's watch, KV-event
        subscribers, budget sync and load scrapes."""
        settings = self.settings
        checker = HealthChecker(
            self.pool,
            client,
            self.metrics.fleet,
            interval=settings.health_check_interval,
            timeout=settings.health_check_timeout,
            traffic=self.router,
        )
        await nursery.start(self.monitor.run)
        await nursery.start(checker.run)
        discoverer = Discoverer(
            self.router, checker.check, self.metrics.fleet, settings.drain_timeout
        )
        self.discoverer = discoverer
        await nursery.start(discoverer.run, discovery_sources(settings))
        if settings.lora_load_on_demand:
            self.adapter_loader = AdapterLoader(
                self.pool,
                client,
                settings.adapters,
                self.metrics.fleet,
                wait_timeout=settings.admission_timeout,
            )
            await nursery.start(self.adapter_loader.run)
            self.decider.adapters = self.adapter_loader
        await nursery.start(self.router.run)
        for subscriber in self.kv_subscribers.values():
            await nursery.start(subscriber.run)
        if self.budget_sync is not None:
            await nursery.start(self.budget_sync.run)
        scraper = LoadScraper(
            self.pool,
            client,
            settings.health_check_timeout,
            traffic=self.router,
            reported=self.router.gate.opened,
        )
        nursery.start_soon(scraper.run)
        return discoverer

    async def _start_proxy(self, nursery: trio.Nursery, upstream: UpstreamPool) -> ProxyApp:
        """The proxy door and what it forwards through, its exporters running."""
        await nursery.start(upstream.expire_late_heads)
        relay_hub = RelayHub()
        await nursery.start(relay_hub.run)
        await nursery.start(self.tracer.run)
        if self.access_log is not None:
            await nursery.start(self.access_log.run)
        proxy_room = proxy_settings(self.settings)
        forwarder = Forwarder(
            proxy_room.idle_timeout,
            self.pool,
            self.router,
            self.decider,
            self.metrics.doors,
            upstream,
            relay_hub,
        )
        disaggregation = Disaggregation(
            disaggregation_settings(self.settings), self.decider, self.pool
        )
        two_hops = TwoHops(forwarder, disaggregation, self.metrics.pd)
        return ProxyApp(proxy_room, self.reception, forwarder, self.metrics.registry, two_hops)

    async def _serve(
        self,
        proxy: ProxyApp,
        discoverer: Discoverer,
        task_status: trio.TaskStatus[tuple[str, str]],
    ) -> None:
        """The dashboard, the proxy's port and the endpoint picker's, until `shutdown`; then
        in-flight requests get --shutdown-grace to finish."""
        settings = self.settings
        sources = DashboardSources(
            self.snapshot,
            self.occupancy,
            self.set_saturation,
            self.metrics_text,
            self.request_burst,
            BackendControl(
                self.router, discoverer, discoverer.check, settings.health_check_timeout
            ),
            self.router,
        )
        server = self.server_factory(proxy)
        async with trio.open_nursery() as servers:
            # The dashboard first: building its app holds the loop ~5 ms, before any
            # request can wait for it.
            self.dashboard_feed, dashboard_url = await servers.start(
                serve_dashboard,
                dashboard_server(settings),
                settings.admin_token,
                sources,
                self.shutdown.wait,
            )
            proxy_url = await servers.start(
                server.serve, settings.host, settings.port, settings.backlog
            )
            epp: EppDoor | None = None
            if settings.epp_port is not None:
                picker = EndpointPicker(
                    self.reception,
                    self.decider,
                    self.pool,
                    self.metrics.doors,
                    settings.max_body_bytes,
                )
                epp = EppDoor(picker, self.pool)
                self.epp_port = await servers.start(epp.serve, settings.host, settings.epp_port)
                # Printed as the URLs are: what a script (and `python -m load`) reads back.
                print(f"Sluice endpoint picker: {settings.host}:{self.epp_port}", flush=True)
            # Everything loaded so far (modules, the tokenizer's tables, the template) lives
            # as long as the process: out of the collector's sight, a full collection no
            # longer walks ~56,000 objects while the loop waits (20-90 ms pauses, here).
            gc.freeze()
            task_status.started((proxy_url, dashboard_url))
            await self.shutdown.wait()
            server.close()
            if epp is not None:
                epp.close()
            with trio.move_on_after(settings.shutdown_grace):
                await server.wait_idle()
                if epp is not None:
                    await epp.wait_idle()
            servers.cancel_scope.cancel()


async def stop_on_signal(
    shutdown: trio.Event, cancel: trio.CancelScope, *, task_status: trio.TaskStatus[None]
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            if shutdown.is_set():
                log.info("second signal: stopping now")
                cancel.cancel()
                return
            log.info("%s: finishing in-flight requests, then stopping", signal.Signals(signum).name)
            shutdown.set()


async def run_then_cancel(
    sluice: Sluice, cancel: trio.CancelScope, *, task_status: trio.TaskStatus[tuple[str, str]]
) -> None:
    """Once the servers have drained, nothing else in the process may outlive them."""
    await sluice.run(task_status=task_status)
    cancel.cancel()


def print_urls(proxy_url: str, dashboard_url: str) -> None:
    print(f"Sluice proxy:     {proxy_url}", flush=True)
    print(f"Sluice dashboard: {dashboard_url}", flush=True)
