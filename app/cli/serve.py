"""One `trio.run`, one nursery: proxy server, dashboard server, stall monitor, health checker
(`sluice demo` adds its simulated backends and traffic as child processes: app/cli/demo.py).

SIGINT/SIGTERM: stop accepting, let in-flight responses finish within the grace period,
then cancel everything and exit 0. A second signal cancels at once.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from app.asgi import server_config
from app.budgets.shared import SharedBudgets
from app.budgets.sync import BudgetCollector, BudgetSync
from app.cli.allocator import fix_mmap_threshold
from app.cli.supervisor import Supervisor, WorkerStartFailed, worker_exit_status
from app.config import ConfigError, Saturation, Settings
from app.dashboard.app import create_dashboard
from app.dashboard.backends_api import CONTROL_KEY, BackendControl
from app.dashboard.feed import DashboardFeed
from app.dashboard.workers_view import WorkersView
from app.fleet.backends import BackendPool
from app.fleet.catalog import ModelCatalog, configured_backends
from app.fleet.health import HealthChecker
from app.fleet.load_scraper import LoadScraper
from app.fleet.tokenizer_check import check_tokenizers_at_startup
from app.http.client import UpstreamPool
from app.http.relay_hub import RelayHub
from app.http.server import HttpServer
from app.kv_events.subscriber import subscribers_for
from app.observe.backend_stats import backend_rows
from app.observe.kv_event_metrics import KvEventCollector
from app.observe.loop_monitor import LoopMonitor
from app.observe.metric_summaries import counts_by_label, counts_by_two_labels, tokenize_summary
from app.observe.metrics import Metrics
from app.observe.model_stats import model_rows
from app.observe.worker_metrics import WorkerInfo
from app.preprocess.chat_template import TemplateLoadError
from app.preprocess.model_preps import check_one_tokenizer
from app.preprocess.pipeline import Preprocessor
from app.preprocess.tokenizer_loading import TokenizerLike, TokenizerLoadError
from app.proxy.app import ProxyApp
from app.routing.router import Router
from app.sim.server import create_sim_app, serve_sim
from app.sim.settings import SimSettings

log = logging.getLogger("sluice")

GIL_SWITCH_INTERVAL_S = 0.001


def make_health_client(settings: Settings) -> httpx.AsyncClient:
    """For health checks and model lists; forwarding has its own lean pool (upstream.py)."""
    return httpx.AsyncClient(timeout=settings.health_check_timeout, trust_env=False)


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
        self.metrics = Metrics()
        if worker is not None:
            self.metrics.registry.register(WorkerInfo(worker))
        self.pool = BackendPool(
            settings.all_backends,
            failures_to_open=settings.breaker_failures,
            cooldown=settings.breaker_cooldown,
            probe_path=settings.health_check_path,
            configured=configured_backends(settings.models),
        )
        self.catalog = ModelCatalog(settings.models, settings.max_model_len)
        self.router = Router(settings, self.pool, self.metrics)
        self.policy = self.router.policy
        self.budget_sync: BudgetSync | None = None
        if isinstance(self.router.buckets, SharedBudgets) and settings.redis_url:
            self.budget_sync = BudgetSync(self.router.buckets, settings.redis_url)
            self.metrics.registry.register(BudgetCollector(self.budget_sync))
        self.kv_subscribers = subscribers_for(settings, self.pool, self.policy)
        self.router.kv_events = {url: s.events for url, s in self.kv_subscribers.items()}
        self.metrics.registry.register(KvEventCollector(self.kv_event_snapshots))
        self.checker: HealthChecker | None = None  # set once running (backends added later)
        self.monitor = LoopMonitor(
            self.metrics, settings.stall_threshold_ms, settings.stall_instrument
        )
        self.preprocessor = Preprocessor(
            settings, self.metrics, tokenizer=tokenizer, phase=self.monitor.phase
        )
        if settings.forward == "tokens":
            check_one_tokenizer(self.preprocessor.preps)
        self.shutdown = trio.Event()
        # `sluice demo` sets this: the dashboard's "send a burst" button calls it.
        self.request_burst: Callable[[], bool] | None = None
        self.dashboard_feed: DashboardFeed | None = None  # once running

    def set_saturation(self, policy: Saturation) -> None:
        log.info("saturation policy is now %s", policy)
        self.preprocessor.saturation = policy

    def snapshot(self) -> dict[str, Any]:
        now = trio.current_time()
        traffic = self.metrics.traffic
        backends = self.pool.snapshot(now)
        metrics = self.metrics
        codes = counts_by_two_labels(metrics.backend_requests, "backend", "code")
        backend_rows(backends, codes, traffic.backends.snapshot(time.perf_counter()))
        requests = traffic.snapshot()
        preps = self.preprocessor.preps
        models = model_rows(
            self.catalog.directory(self.pool.backends),
            backends,
            preps.describe(),
            preps.default.describe(),
            counts_by_two_labels(metrics.requests, "model", "code"),
            {
                name: counts_by_label(getattr(metrics, name), "model")
                for name in ("l0_hits", "l0_misses", "l1_hits", "l1_misses")
            },
            requests["recent"],
        )
        kv_events = self.kv_event_snapshots()
        for backend in backends:
            backend["kv_events"] = kv_events.get(backend["url"])
        return {
            "time": now,
            "wall_time": time.time(),
            "policy": self.policy.name,
            "models": models,
            "backends": backends,
            "routing": self.router.snapshot(),
            "preprocess": self.preprocessor.snapshot(),
            "loop": self.monitor.snapshot(),
            "tokenize": tokenize_summary(self.metrics),
            "requests": requests,
            "budgets": self.budgets_snapshot(),
            "notices": self.budget_sync.notices() if self.budget_sync else [],
        }

    def budgets_snapshot(self) -> dict[str, Any] | None:
        if self.budget_sync is not None:
            return self.budget_sync.snapshot()
        buckets = self.router.buckets
        return buckets.snapshot(trio.current_time()) if isinstance(buckets, SharedBudgets) else None

    async def metrics_text(self) -> bytes:
        return self.metrics.render()

    def kv_event_snapshots(self) -> dict[str, dict[str, Any]]:
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
        # Building a client loads CA certificates (~30 ms): not on the loop.
        client = await trio.to_thread.run_sync(make_health_client, settings)
        async with client, self.preprocessor.running(), trio.open_nursery() as nursery:
            checker = HealthChecker(
                self.pool,
                client,
                self.metrics,
                interval=settings.health_check_interval,
                timeout=settings.health_check_timeout,
            )
            self.checker = checker
            await nursery.start(self.monitor.run)
            await nursery.start(checker.run)
            for subscriber in self.kv_subscribers.values():
                await nursery.start(subscriber.run)
            if self.budget_sync is not None:
                await nursery.start(self.budget_sync.run)
            scraper = LoadScraper(
                self.pool,
                client,
                settings.health_check_timeout,
                traffic=lambda: self.router.reservations,
            )
            nursery.start_soon(scraper.run)
            upstream = UpstreamPool(
                connect_timeout=settings.connect_timeout,
                first_byte_timeout=settings.first_byte_timeout,
                max_connections=settings.max_connections,
            )
            await nursery.start(upstream.expire_late_heads)
            relay_hub = RelayHub()
            await nursery.start(relay_hub.run)
            proxy = ProxyApp(
                settings,
                self.pool,
                self.router,
                upstream,
                self.preprocessor,
                self.metrics,
                self.catalog,
                relay_hub,
            )
            feed = self.dashboard_feed = DashboardFeed(
                self.snapshot,
                self.occupancy,
                demo=self.request_burst is not None,
                write_needs_token=settings.admin_token is not None,
            )
            await nursery.start(feed.run)
            dashboard = create_dashboard(
                feed,
                self.set_saturation,
                settings.admin_token,
                bound_host=settings.dashboard_host,
                request_burst=self.request_burst,
                metrics_text=self.metrics_text,
            )
            dashboard.config[CONTROL_KEY] = BackendControl(
                self.router, checker.check, settings.health_check_timeout
            )
            # Tokens mode: no backend takes traffic before its tokenizer was compared, so
            # compare before listening.
            await check_tokenizers_at_startup(self.pool, settings.health_check_timeout)
            server = self.server_factory(proxy)
            async with trio.open_nursery() as servers:
                proxy_url = await servers.start(
                    server.serve, settings.host, settings.port, settings.backlog
                )
                dashboard_urls = await servers.start(
                    _serve,
                    dashboard,
                    server_config(settings.dashboard_host, settings.dashboard_port, 1.0),
                    self.shutdown.wait,
                )
                # Everything loaded so far (modules, the tokenizer's tables, the template) lives
                # as long as the process: out of the collector's sight, a full collection no
                # longer walks ~56,000 objects while the loop waits (20-90 ms pauses, here).
                gc.freeze()
                task_status.started((proxy_url, dashboard_urls[0]))
                await self.shutdown.wait()
                server.close()
                with trio.move_on_after(settings.shutdown_grace):
                    await server.wait_idle()
                servers.cancel_scope.cancel()
            await upstream.aclose()
            nursery.cancel_scope.cancel()


async def _serve(
    app: Any,
    config: Config,
    shutdown_trigger: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)


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


async def serve_main(settings: Settings) -> None:
    if settings.workers > 1:
        await supervised_main(settings)
        return
    sluice = Sluice(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(stop_on_signal, sluice.shutdown, nursery.cancel_scope)
        print_urls(*await nursery.start(run_then_cancel, sluice, nursery.cancel_scope))


async def supervised_main(settings: Settings) -> None:
    """`--workers N`: the supervisor, its workers and the one dashboard that shows them."""
    supervisor = Supervisor(settings)
    if settings.tokens_per_minute and settings.redis_url is None:
        log.warning(
            "--workers %d without --redis-url: each worker admits 1/%d of every key's "
            "--tokens-per-minute (a client on one connection gets that share)",
            settings.workers,
            settings.workers,
        )
    async with trio.open_nursery() as nursery:
        await nursery.start(_forward_signals, supervisor)
        client = await trio.to_thread.run_sync(make_health_client, settings)
        async with client:
            view = WorkersView(
                supervisor.workers, client, supervisor.worker_token, supervisor.saturation
            )
            feed = DashboardFeed(
                view.snapshot,
                view.occupancy,
                demo=False,
                write_needs_token=settings.admin_token is not None,
            )
            dashboard = create_dashboard(
                feed,
                view.set_saturation,
                settings.admin_token,
                bound_host=settings.dashboard_host,
                metrics_text=view.metrics_text,
            )
            dashboard.config[CONTROL_KEY] = None  # backends are changed per worker, at start
            port = await nursery.start(supervisor.run)
            await nursery.start(view.run)
            await nursery.start(feed.run)
            dashboard_urls = await nursery.start(
                _serve,
                dashboard,
                server_config(settings.dashboard_host, settings.dashboard_port, 1.0),
                supervisor.shutdown.wait,
            )
            print(f"Sluice workers:   {settings.workers}", flush=True)
            print_urls(f"http://{settings.host}:{port}", dashboard_urls[0])
            await supervisor.stopped.wait()
            nursery.cancel_scope.cancel()


async def _forward_signals(
    supervisor: Supervisor, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The first signal stops the workers gracefully; each later one is passed on too (a
    worker's second signal stops it at once)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            if supervisor.shutdown.is_set():
                log.info("second signal: stopping the workers now")
                supervisor.signal_workers(signal.SIGTERM)
                continue
            log.info(
                "%s: every worker finishes its in-flight requests, then stops",
                signal.Signals(signum).name,
            )
            supervisor.shutdown.set()


def _configure_logging(level: str, worker: int | None = None) -> None:
    who = "" if worker is None else f"[worker {worker}] "
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s",
        stream=sys.stderr,
    )
    # One line per forwarded request is the access log's job, not the client library's.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_until_stopped(
    main: Callable[[Settings], Awaitable[None]], settings: Settings, worker: int | None = None
) -> int:
    """Run until stopped; a tokenizer or template that cannot load, or a configuration that
    cannot work, is a clear exit 2, and so is a worker of `--workers N` that could not start
    (with that worker's status)."""
    _configure_logging(settings.log_level, worker)
    # Should the process ever die of a fatal signal (a C extension's bug), its log says where.
    faulthandler.enable()
    # A worker thread that holds the GIL (the tokenizer turning ids into Python objects) keeps
    # the loop waiting until the interpreter asks it to yield: every 5 ms by default. At 1 ms,
    # `python -m load bench hardening --part long-chats` measured /health p99 8-10 ms instead
    # of 13-20 ms and a third of the GIL-wait stalls; with no second thread wanting the GIL,
    # it costs nothing.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    fix_mmap_threshold()
    status = 0
    try:
        trio.run(main, settings)
    except* (TokenizerLoadError, TemplateLoadError, ConfigError) as group:
        for exc in group.exceptions:
            print(f"sluice: {exc}", file=sys.stderr)
        status = 2
    except* WorkerStartFailed as failed:
        for failure in _leaves(failed):
            print(f"sluice: {failure}", file=sys.stderr)
            status = worker_exit_status(failure) or 2
    return status


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    """The exceptions of a group and of the groups nested in it (nurseries in nurseries)."""
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves


def run_serve(settings: Settings) -> int:
    return run_until_stopped(serve_main, settings)


def run_sim_backend(settings: SimSettings) -> int:
    _configure_logging("info")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            shutdown = trio.Event()
            await nursery.start(stop_on_signal, shutdown, nursery.cancel_scope)
            app = create_sim_app(settings)
            url = await nursery.start(partial(serve_sim, settings, app=app))
            print(f"Simulated backend: {url}", flush=True)
            if app.kv_publisher is not None:
                print(f"KV events: {app.kv_publisher.endpoint}", flush=True)
                if app.kv_publisher.replay_endpoint:
                    print(f"KV events replay: {app.kv_publisher.replay_endpoint}", flush=True)
            await shutdown.wait()
            nursery.cancel_scope.cancel()

    trio.run(main)
    return 0
