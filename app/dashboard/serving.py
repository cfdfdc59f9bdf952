"""The dashboard served: its feed and its QuartTrio app on hypercorn, on `--dashboard-port`.

Written once for both processes that serve a dashboard: a proxy (`app/cli/sluice.py`) and
the supervisor of `--workers N` (`app/cli/serve.py`), which differ only in where the
snapshot, the saturation switch and the metrics come from (`DashboardSources`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from app.config import Settings
from app.dashboard.app import MetricsText, RequestBurst, SetSaturation, create_dashboard
from app.dashboard.backends_api import CONTROL_KEY, BackendControl
from app.dashboard.feed import BuildSnapshot, DashboardFeed, ReadOccupancy
from app.fleet.traffic import TrafficSource

SHUTDOWN_GRACE_S = 1.0


@dataclass(frozen=True)
class DashboardSources:
    snapshot: BuildSnapshot
    occupancy: ReadOccupancy
    set_saturation: SetSaturation
    metrics_text: MetricsText
    request_burst: RequestBurst | None = None  # `sluice demo`'s burst button
    control: BackendControl | None = None  # None: no backends added or removed from the page
    traffic: TrafficSource | None = None  # None: the feed ticks at one pace, traffic or not


def server_config(host: str, port: int, backlog: int) -> Config:
    """Hypercorn's settings for the dashboard (port 0 picks a free port)."""
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.backlog = backlog
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.include_server_header = False
    config.graceful_timeout = SHUTDOWN_GRACE_S
    config.keep_alive_timeout = 75
    return config


async def serve_dashboard(
    settings: Settings,
    sources: DashboardSources,
    shutdown: Callable[[], Any],
    *,
    task_status: trio.TaskStatus[tuple[DashboardFeed, str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown()` returns (and hypercorn has closed its connections); report
    the feed and the page's URL once listening."""
    feed = DashboardFeed(
        sources.snapshot,
        sources.occupancy,
        demo=sources.request_burst is not None,
        write_needs_token=settings.admin_token is not None,
        traffic=sources.traffic,
    )
    dashboard = create_dashboard(
        feed,
        sources.set_saturation,
        settings.admin_token,
        bound_host=settings.dashboard_host,
        request_burst=sources.request_burst,
        metrics_text=sources.metrics_text,
    )
    dashboard.config[CONTROL_KEY] = sources.control
    config = server_config(settings.dashboard_host, settings.dashboard_port, settings.backlog)
    async with trio.open_nursery() as feeding:
        await feeding.start(feed.run)
        async with trio.open_nursery() as serving:
            app: Any = dashboard  # hypercorn's ASGI types are narrower than Quart's
            urls: list[str] = await serving.start(
                partial(serve, app, config, shutdown_trigger=shutdown)
            )
            task_status.started((feed, urls[0]))
        feeding.cancel_scope.cancel()  # hypercorn has shut down, gracefully
