"""The dashboard: a QuartTrio app on its own port, reading snapshots the runtime assembles."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import trio
from quart import Response, render_template
from quart_trio import QuartTrio

ROOT = Path(__file__).resolve().parents[2]
EVENT_INTERVAL_SECONDS = 1.0

Snapshot = Callable[[], dict[str, Any]]


def create_dashboard(snapshot: Snapshot) -> QuartTrio:
    app = QuartTrio(
        __name__,
        template_folder=str(ROOT / "templates"),
        static_folder=str(ROOT / "static"),
    )

    @app.get("/")
    async def page() -> str:
        return await render_template("dashboard.html")

    @app.get("/api/snapshot")
    async def api_snapshot() -> dict[str, Any]:
        return snapshot()

    @app.get("/api/events")
    async def api_events() -> Response:
        async def events() -> AsyncIterator[bytes]:
            while True:
                yield b"data: " + json.dumps(snapshot()).encode() + b"\n\n"
                await trio.sleep(EVENT_INTERVAL_SECONDS)

        response = Response(events(), content_type="text/event-stream")
        response.headers["cache-control"] = "no-cache"
        response.timeout = None
        return response

    return app
