"""The dashboard: a QuartTrio app on its own port, reading snapshots the runtime assembles."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import trio
from quart import Response, render_template, request
from quart_trio import QuartTrio

from app.config import Saturation

HERE = Path(__file__).resolve().parent


def asset_folder(name: str) -> Path:
    """`templates` or `static`: inside the package once installed from a wheel, at the top
    of the repository in a checkout (and an editable install)."""
    installed = HERE / name
    return installed if installed.is_dir() else HERE.parents[1] / name

EVENT_INTERVAL_SECONDS = 1.0

Snapshot = Callable[[], dict[str, Any]]
SetSaturation = Callable[[Saturation], None]
SATURATION_POLICIES: tuple[Saturation, ...] = ("wait", "bail-out")


def _error(status: int, message: str, param: str | None = None) -> tuple[dict[str, Any], int]:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return {"error": error}, status


def create_dashboard(
    snapshot: Snapshot, set_saturation: SetSaturation, admin_token: str | None
) -> QuartTrio:
    app = QuartTrio(
        __name__,
        template_folder=str(asset_folder("templates")),
        static_folder=str(asset_folder("static")),
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

    @app.put("/api/policy")
    async def api_policy() -> tuple[dict[str, Any], int]:
        if admin_token is not None:
            given = request.headers.get("authorization", "")
            if given != f"Bearer {admin_token}":
                return _error(401, "PUT /api/policy needs 'Authorization: Bearer <admin token>'")
        payload = await request.get_json(force=True, silent=True)
        if not isinstance(payload, dict):
            return _error(400, 'expected a JSON object like {"saturation": "wait"}')
        saturation = payload.get("saturation")
        if saturation not in SATURATION_POLICIES:
            return _error(400, "'saturation' must be 'wait' or 'bail-out'", "saturation")
        set_saturation(saturation)
        return {"saturation": saturation}, 200

    return app
