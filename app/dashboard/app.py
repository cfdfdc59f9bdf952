"""The dashboard: a QuartTrio app on its own port. It reads what the feed publishes and makes
the writes an operator has: the saturation policy, backends added and removed
(backends_api.py) and, in the demo, a burst.

Its routes and what each answers are README.md's endpoint table, generated from this app's URL
map (`python -m app.cli.reference`). Every error is raised and answered as app/errors.py's
`answer_for` says (OpenAI-shaped JSON), like the proxy's. Who may do what: security.py.
"""

from __future__ import annotations

import inspect
import mimetypes
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from app.config import Saturation
from app.dashboard.answers import Answer, CheckWrite, error_response, json_object
from app.dashboard.backends_api import CONTROL_KEY, BackendControl, register_backends_api
from app.dashboard.feed import BuildSnapshot, DashboardFeed, ReadOccupancy
from app.dashboard.schema import snapshot_schema_bytes
from app.dashboard.security import bearer_matches, host_allowed, same_origin
from app.errors import ClientError, Refused, SluiceError
from app.fleet.traffic import TrafficSource

HERE = Path(__file__).resolve().parent
MAX_WRITE_BYTES = 4096
SATURATION_POLICIES: tuple[Saturation, ...] = ("wait", "bail-out")
PAGE_HEADERS = {
    # The page loads nothing but its own files, and no other site may frame the switch.
    "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}

# A supervisor's answers once every worker has taken the new policy.
SetSaturation = Callable[[Saturation], Awaitable[None] | None]
MetricsText = Callable[[], Awaitable[bytes]]
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RequestBurst = Callable[[], bool]


def asset_folder(name: str) -> Path:
    """`templates` or `static`: inside the package once installed from a wheel, at the top
    of the repository in a checkout (and an editable install)."""
    installed = HERE / name
    return installed if installed.is_dir() else HERE.parents[1] / name


# The first static file's type would read the system's MIME tables: ~4 ms of the loop at the
# page's first load (measured), ~7 ms at start-up. Read at import, before the loop runs.
mimetypes.init()
# Generated from the types by reading their annotations: ~10 ms, at import rather than on the loop.
SNAPSHOT_SCHEMA = snapshot_schema_bytes()


@dataclass(frozen=True)
class DashboardSources:
    """Where a dashboard's figures come from and where its writes go: a proxy's own
    (app/cli/sluice.py) or a supervisor's, merged from its workers (app/cli/serve.py)."""

    snapshot: BuildSnapshot
    occupancy: ReadOccupancy
    set_saturation: SetSaturation
    metrics_text: MetricsText
    request_burst: RequestBurst | None = None  # `sluice demo`'s burst button
    control: BackendControl | None = None  # None: no backends added or removed from the page
    traffic: TrafficSource | None = None  # None: the feed ticks at one pace, traffic or not


def create_dashboard(
    feed: DashboardFeed,
    sources: DashboardSources,
    admin_token: str | None,
    *,
    bound_host: str = "127.0.0.1",
) -> QuartTrio:
    app = QuartTrio(__name__, static_folder=str(asset_folder("static")))
    app.config["MAX_CONTENT_LENGTH"] = MAX_WRITE_BYTES
    # A restarted Sluice may serve a newer page: browsers revalidate rather than guess.
    app.config["SEND_FILE_MAX_AGE_DEFAULT"] = 0
    _guard(app, bound_host)
    check_write = _write_check(admin_token)
    _read_routes(app, feed, sources)
    _write_routes(app, feed, sources, check_write)
    app.config[CONTROL_KEY] = sources.control
    register_backends_api(app, check_write)
    return app


def _guard(app: QuartTrio, bound_host: str) -> None:
    """Loopback host names only, the page's headers on every answer, every error in the
    proxy's shape."""

    @app.before_request
    async def refuse_foreign_hosts() -> None:
        if not host_allowed(request.headers.get("host"), bound_host):
            raise ClientError(
                "this dashboard answers to loopback host names only", status=403, type_="forbidden"
            )

    @app.after_request
    async def page_headers(response: Response) -> Response:
        for name, value in PAGE_HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    @app.errorhandler(SluiceError)
    async def sluice_error(error: SluiceError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        """Quart's own refusals (404, 405, 413) in the same shape; its 500s as ours."""
        code = error.code or 500
        if code >= 500:
            return error_response(error)
        allowed = getattr(error, "valid_methods", None)
        headers = [(b"allow", ", ".join(allowed).encode())] if allowed else []
        return error_response(
            ClientError(error.description or error.name, status=code, headers=headers)
        )


def _write_check(admin_token: str | None) -> CheckWrite:
    def check_write() -> None:
        """Raises why this write may not happen, if it may not."""
        headers = request.headers
        if not same_origin(
            headers.get("origin"), headers.get("sec-fetch-site"), headers.get("host")
        ):
            raise ClientError("cross-origin writes are refused", status=403, type_="forbidden")
        if admin_token is not None and not bearer_matches(
            headers.get("authorization"), admin_token
        ):
            raise ClientError(
                "this write needs 'Authorization: Bearer <admin token>'",
                status=401,
                type_="authentication_error",
            )

    return check_write


def _read_routes(app: QuartTrio, feed: DashboardFeed, sources: DashboardSources) -> None:
    # The page is a plain file (no template syntax), read once here: rendered by Jinja at its
    # first request it cost the loop 5-6 ms (measured, `sluice demo` under Chromium).
    page_html = (asset_folder("templates") / "dashboard.html").read_text(encoding="utf-8")

    @app.get("/")
    async def page() -> str:
        return page_html

    @app.get("/api/snapshot")
    async def api_snapshot() -> Response:
        # `?counters=1`: as built, without what this feed derives for a page (a supervisor
        # merges its workers' counters and derives the rates from their sum itself).
        # `?records_after=SEQ`: only the request log's newer records (a supervisor polling
        # its workers every second would otherwise read the same 200 records each time).
        payload = await feed.snapshot_bytes(
            counters=request.args.get("counters") == "1",
            records_after=request.args.get("records_after", 0, type=int),
        )
        return Response(payload, content_type="application/json")

    @app.get("/api/schema")
    async def api_schema() -> Response:
        return Response(SNAPSHOT_SCHEMA, content_type="application/json")

    @app.get("/api/events")
    async def api_events() -> Response:
        if feed.pages >= feed.max_pages:
            message = f"at most {feed.max_pages} pages may listen at once"
            raise Refused(503, "overloaded", None, message, None)

        async def events() -> Any:
            # Browsers retry after this many ms when the stream breaks (Sluice restarting).
            yield b"retry: 1000\n\n"
            # Closed with the response, so that the page stops being counted at once.
            async with aclosing(feed.pages_events()) as payloads:
                async for payload in payloads:
                    yield b"data: " + payload + b"\n\n"

        response = Response(events(), content_type="text/event-stream")
        response.headers["cache-control"] = "no-store"
        response.headers["x-accel-buffering"] = "no"  # tell buffering reverse proxies not to
        response.timeout = None
        return response

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await sources.metrics_text(), content_type=METRICS_CONTENT_TYPE)


def _write_routes(
    app: QuartTrio, feed: DashboardFeed, sources: DashboardSources, check_write: CheckWrite
) -> None:
    set_saturation, request_burst = sources.set_saturation, sources.request_burst

    @app.put("/api/policy")
    async def api_policy() -> Answer:
        payload = await json_object(check_write, '{"saturation": "wait"}')
        unknown = sorted(set(payload) - {"saturation"})
        if unknown:
            raise ClientError(f"unknown field {unknown[0]!r}", unknown[0])
        saturation = payload.get("saturation")
        if saturation not in SATURATION_POLICIES:
            raise ClientError("'saturation' must be 'wait' or 'bail-out'", "saturation")
        applied = set_saturation(saturation)
        if inspect.isawaitable(applied):
            await applied
        feed.poke()
        return {"saturation": saturation}, 200

    @app.post("/api/demo/burst")
    async def api_burst() -> Answer:
        if request_burst is None:
            raise ClientError("bursts are a `sluice demo` feature", status=404)
        check_write()
        return {"queued": request_burst()}, 202
