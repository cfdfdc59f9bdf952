"""Running Sluice until it is stopped: `sluice serve` (one process, sluice.py; with `--workers
N` a supervisor, its workers and one dashboard for all) and `sluice sim-backend`. `sluice
demo` (demo.py) and each worker (worker.py) start through `run_until_stopped` too.

SIGINT/SIGTERM: stop accepting, let in-flight responses finish within the grace period,
then cancel everything and exit 0. A second signal cancels at once.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from app.cli.allocator import fix_mmap_threshold
from app.cli.rooms import dashboard_server
from app.cli.sluice import Sluice, print_urls, run_then_cancel, stop_on_signal
from app.cli.supervisor import Supervisor, WorkerStartFailed, worker_exit_status
from app.config import Settings
from app.dashboard.app import DashboardSources
from app.dashboard.serving import serve_dashboard
from app.dashboard.workers_view import WorkersView
from app.errors import ConfigError
from app.http.fetch import Fetcher
from app.sim.server import create_sim_app, serve_sim
from app.sim.settings import SimSettings

log = logging.getLogger("sluice")

GIL_SWITCH_INTERVAL_S = 0.001


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
        client = Fetcher(connect_timeout=settings.health_check_timeout)
        async with contextlib.aclosing(client):
            view = WorkersView(
                supervisor.workers, client, supervisor.worker_token, supervisor.saturation
            )
            sources = DashboardSources(
                view.snapshot, view.occupancy, view.set_saturation, view.metrics_text
            )
            port = await nursery.start(supervisor.run)
            await nursery.start(view.run)
            _, dashboard_url = await nursery.start(
                serve_dashboard,
                dashboard_server(settings),
                settings.admin_token,
                sources,
                supervisor.shutdown.wait,
            )
            print(f"Sluice workers:   {settings.workers}", flush=True)
            print_urls(f"http://{settings.host}:{port}", dashboard_url)
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
    except* WorkerStartFailed as failed:  # a ConfigError whose status is the worker's
        for failure in _leaves(failed):
            print(f"sluice: {failure}", file=sys.stderr)
            status = worker_exit_status(failure) or 2
    except* ConfigError as group:  # a bad setting, tokenizer, chat template or credentials
        for exc in _leaves(group):  # raised in a nursery within a nursery, it comes nested
            print(f"sluice: {exc}", file=sys.stderr)
        status = 2
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
