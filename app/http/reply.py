"""An answer as a handler hands it to its exchange, in one value: a head and a body that is
whole, or that still arrives from a `BodySource` (a backend's answer, relayed by the relay
hub as it comes). The handler builds it; `Exchange.send` writes it; nothing goes back and
forth between them per piece of the body.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from app.errors import UpstreamError, answer_for
from app.http.fields import Headers
from app.http.relay_hub import RelayHub
from app.http.streams import ByteStream


class BodySource(Protocol):
    """The rest of a body, read from `stream` by `hub` (silent for `idle` seconds: broken)."""

    stream: ByteStream
    hub: RelayHub
    idle: float

    def take(self, raw: bytes) -> bytes:
        """The content of one read (UpstreamError on broken framing; b"" at end of input)."""
        ...

    def complete(self) -> bool: ...

    def last(self, data: bytes) -> bytes:
        """The body's last content: `data`, and anything the source still held."""
        ...

    def started(self) -> None:
        """Its first bytes went out."""
        ...

    def broken(self, failure: UpstreamError) -> bytes | None:
        """What ends a body broken off by `failure` cleanly (an event stream's error event),
        or None: then the connection closes, so a body cut short never looks complete."""
        ...

    async def release(self) -> None:
        """Done with `stream` (it may be kept for another request)."""
        ...


@dataclass(slots=True)
class Reply:
    status: int
    headers: Headers  # they frame a whole body (Content-Length), or it is chunked
    body: bytes = b""  # all of it without a source, else what came first
    source: BodySource | None = None


def whole(status: int, headers: Headers, body: bytes) -> Reply:
    return Reply(status, [*headers, (b"content-length", b"%d" % len(body))], body)


def json_reply(status: int, payload: Any, headers: Iterable[tuple[bytes, bytes]] = ()) -> Reply:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return whole(status, [(b"content-type", b"application/json"), *headers], body)


def error_reply(error: BaseException, extra: Iterable[tuple[bytes, bytes]] = ()) -> Reply:
    """`error` answered as app/errors.py says, with `extra` headers."""
    answer = answer_for(error)
    return json_reply(answer.status, answer.body, [*answer.headers, *extra])
