"""Backends at run time, on the dashboard port (the operator's side, never the proxy's):

    GET    /api/backends        the pool, as in the snapshot's "backends"
    POST   /api/backends        {"url": "http://host:port"}: probed at once, 201 with its state
                                (and "role": "prefill" | "decode", "bootstrap_port": N for
                                an engine of disaggregated serving)
    DELETE /api/backends/{id}   by the id the listing shows (or the URL, percent-encoded):
                                it drains (app/fleet/discoverer.py)

Writes go through the dashboard's own `check_write` (admin token, same origin), like every
write there. A new backend takes traffic once its health check passes (the answer says
whether it did); a removed one gets no new request at once, its requests in flight have
`--drain-timeout` to finish, and the routing index forgets it. A backend a discovery source
found comes back at that source's next lookup that still lists it: change the source to
keep it out. Errors are OpenAI-shaped JSON.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypedDict
from urllib.parse import unquote, urlsplit

import trio
from quart import current_app
from quart_trio import QuartTrio

from app.config import BackendRole
from app.dashboard.answers import Answer, CheckWrite, json_object
from app.errors import ClientError
from app.fleet.backend_row import BackendRow
from app.fleet.backends import Backend
from app.fleet.discoverer import Discoverer
from app.routing.router import Router

CONTROL_KEY = "SLUICE_BACKEND_CONTROL"
MAX_BACKENDS = 64
MAX_URL_CHARS = 2048


class RemovedBackend(TypedDict):
    """A backend that left the pool while it was being added."""

    id: str
    url: str
    removed: Literal[True]


def check_backend_url(url: Any) -> str:
    """A normalised `http://host[:port][/prefix]`, or ValueError saying what is wrong."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise ValueError("'url' must be a non-empty string like 'http://gpu-1:8000'")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r} is not a valid URL") from None
    if parts.scheme != "http":
        raise ValueError(f"{url!r}: only http:// backend URLs are supported")
    if not parts.hostname or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{url!r}: give scheme, host, port and at most a path prefix")
    if port == 0:
        raise ValueError(f"{url!r}: port 0 cannot be reached")
    return url.rstrip("/")


class BackendControl:
    """What the endpoints change: the router's pool, and a health check on demand."""

    def __init__(
        self,
        router: Router,
        discoverer: Discoverer,
        check: Callable[[Backend], Awaitable[None]],
        timeout: float,
    ) -> None:
        self.router = router
        self.discoverer = discoverer
        self.check = check
        self.timeout = timeout

    def listing(self) -> list[BackendRow]:
        return self.router.pool.snapshot(trio.current_time())

    def describe(self, backend: Backend) -> BackendRow | RemovedBackend:
        for entry in self.listing():
            if entry["id"] == backend.id:
                return entry
        return {"id": backend.id, "url": backend.url, "removed": True}

    async def add(self, url: str, role: BackendRole | None = None) -> Backend:
        backend = self.router.add_backend(url, role)  # ValueError if it is already there
        self.discoverer.added(backend)
        with trio.move_on_after(self.timeout * 2):  # the probe has its own timeouts too
            await self.check(backend)
        return backend


def _role(url: str, role: Any, bootstrap_port: Any) -> BackendRole | None:
    """A backend's role in disaggregated serving, as `--prefill`/`--decode` give it."""
    if role == "both" and bootstrap_port is None:
        return None
    if not isinstance(role, str) or not (bootstrap_port is None or type(bootstrap_port) is int):
        raise ClientError("'role' is a string, 'bootstrap_port' an integer", "role")
    try:
        return BackendRole(url, role, bootstrap_port)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ClientError(str(exc), "role") from None


def register_backends_api(app: QuartTrio, check_write: CheckWrite) -> None:
    """Add the endpoints; `app.config[CONTROL_KEY]` holds the `BackendControl` to use."""

    def control() -> BackendControl:
        found: BackendControl | None = current_app.config[CONTROL_KEY]
        if found is None:  # the dashboard of `--workers N`, whose workers hold their pools
            raise ClientError(
                "with --workers, each worker keeps the backends it was started with: change "
                '--backend and restart (the snapshot\'s "backends" lists them)',
                code="workers",
                status=409,
            )
        return found

    @app.get("/api/backends")
    async def list_backends() -> Answer:
        return {"backends": control().listing()}, 200

    @app.post("/api/backends")
    async def add_backend() -> Answer:
        payload = await json_object(check_write, '{"url": "http://gpu-1:8000"}')
        try:
            url = check_backend_url(payload.get("url"))
        except ValueError as exc:
            raise ClientError(str(exc), "url") from None
        role = _role(url, payload.get("role", "both"), payload.get("bootstrap_port"))
        pool = control().router.pool
        if len(pool.backends) >= MAX_BACKENDS:
            message = f"the pool already has {MAX_BACKENDS} backends"
            raise ClientError(message, "url", "too_many", status=409)
        try:
            backend = await control().add(url, role)
        except ValueError as exc:
            raise ClientError(str(exc), "url", "backend_exists", status=409) from None
        return {"backend": control().describe(backend)}, 201

    @app.delete("/api/backends/<path:backend_id>")
    async def remove_backend(backend_id: str) -> Answer:
        check_write()
        router = control().router
        backend = router.pool.find(unquote(backend_id))
        if backend is None:
            raise ClientError(
                f"no backend {backend_id!r}; GET /api/backends lists them", status=404
            )
        if len(router.pool.backends) == 1:
            raise ClientError("the last backend cannot be removed; add another first", status=409)
        control().discoverer.remove(backend)
        removed = {"id": backend.id, "url": backend.url, "draining": backend.inflight}
        return {"removed": removed}, 200
