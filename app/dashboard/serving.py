"""The dashboard served: its feed and its QuartTrio app on hypercorn, on `--dashboard-port`.

Written once for both processes that serve a dashboard: a proxy (`app/cli/sluice.py`) and
the supervisor of `--workers N` (`app/cli/serve.py`), which differ only in where the
snapshot, the saturation switch and the metrics come from (`DashboardSources`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from app.config import ServerSettings
from app.dashboard.app import DashboardSources, create_dashboard
from app.dashboard.feed import DashboardFeed

SHUTDOWN_GRACE_S = 1.0


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
    server: ServerSettings,
    admin_token: str | None,
    sources: DashboardSources,
    shutdown: Callable[[], Any],
    *,
    task_status: trio.TaskStatus[tuple[DashboardFeed, str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve on `server` until `shutdown()` returns (and hypercorn has closed its
    connections); report the feed and the page's URL once listening. `admin_token`:
    --admin-token, or None."""
    feed = DashboardFeed(
        sources.snapshot,
        sources.occupancy,
        demo=sources.request_burst is not None,
        write_needs_token=admin_token is not None,
        traffic=sources.traffic,
    )
    dashboard = create_dashboard(feed, sources, admin_token, bound_host=server.host)
    config = server_config(server.host, server.port, server.backlog)
    async with trio.open_nursery() as feeding:
        await feeding.start(feed.run)
        async with trio.open_nursery() as serving:
            app: Any = dashboard  # hypercorn's ASGI types are narrower than Quart's
            urls: list[str] = await serving.start(
                partial(serve, app, config, shutdown_trigger=shutdown)
            )
            task_status.started((feed, urls[0]))
        feeding.cancel_scope.cancel()  # hypercorn has shut down, gracefully
