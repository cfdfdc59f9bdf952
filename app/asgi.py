"""The few ASGI primitives of the servers hypercorn runs: the simulated backend (a lean ASGI
app, no framework), the dashboard's settings, and the backends tests write by hand.

These helpers read a bounded request body and send whole JSON responses and OpenAI-shaped
errors. The proxy's own port is not ASGI: app/http/server.py serves it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from hypercorn.config import Config

from app.http.errors import ClientError, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


class ClientGone(Exception):
    pass


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; a 413 `ClientError` past `limit` bytes, `ClientGone` on
    disconnect."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            # The rest of the body stays unread, so the server must close the connection;
            # saying so keeps a keep-alive client from sending its next request into it.
            raise ClientError(
                f"The request body is larger than {limit} bytes.",
                code="request_too_large",
                status=413,
                headers=[(b"connection", b"close")],
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, payload: Any, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode()
    await send_bytes(send, status, body, b"application/json", headers)


async def send_error(
    send: Send,
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | int | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    await send_json(send, status, error_body(message, type_, param, code), headers)


async def send_client_error(send: Send, error: ClientError) -> None:
    await send_json(send, error.status, error.body(), error.headers)


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge startup and shutdown: nothing of ours needs the lifespan hooks."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


# Connections the kernel may hold before the server accepts them. Hypercorn's default of 100
# reset 20-30% of 1,000 connections opened at once, here; uvicorn's default is 2048.
DEFAULT_BACKLOG = 2048


def server_config(
    host: str, port: int, grace: float = 1.0, backlog: int = DEFAULT_BACKLOG
) -> Config:
    """Hypercorn settings shared by every server Sluice runs (port 0 picks a free port)."""
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.backlog = backlog
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.include_server_header = False
    config.graceful_timeout = grace
    config.keep_alive_timeout = 75
    return config
