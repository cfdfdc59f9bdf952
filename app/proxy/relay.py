"""Relaying a backend's answer to the client as it arrives: the proxy's per-token hot path.

The request's task sends the head and whatever body came with it, then the body's rest
moves by one of two pumps, both calling `_Passage.take` once per read of the backend's
socket (decode the framing, body_framing.py; convert for `--forward tokens`; keep the
tail) and writing what one read brought in one frame and one write: whatever arrived
between two reads goes out together, so a busy proxy coalesces tokens and an idle one adds
no delay. Where both ends are sockets and the client's body is chunked or runs until close,
the relay hub (relay_hub.py) moves it, one task for every stream, without waking the
request's task per token; otherwise (a counted body, whose length h11 keeps; streams that
are not sockets, as in tests) the request's task pumps it itself. Nothing else runs per
token: usage, `cached_tokens` and the finish reason are read from the tail once the answer
has ended (routing/usage.py), the request's trace reads the exchange's first-byte time
once, and there is no per-chunk metric.

A backend silent for `idle` seconds ends the relay. In the request's task the timeout is one
cancel scope whose deadline moves forward only when it comes within `idle` of now (by
`idle` and a tenth), so a stream pays a clock read per read, not a deadline change; it fires
between `idle` and 1.1 x `idle` after the last byte. A client slow to take the answer is
back-pressure, not a silent backend: the deadline is lifted while a write waits for the
client. (The hub keeps its own, the same way.)

On a failure mid-answer an event stream gets an error event and a clean end; any other body
raises `StreamBroken`, so the server drops the connection rather than let a truncated JSON
document look complete. `relay_as_chat` is the relay for `--forward tokens` chat requests:
the backend answered a completion, the client gets a chat completion (chat_conversion.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import trio

from app.http.client import UpstreamError, UpstreamResponse
from app.http.exchange import ClientGone, Exchange
from app.http.fields import Headers
from app.http.relay_hub import Ended, HubStream, RelayHub
from app.proxy.chat_conversion import ChatStreamConverter, completion_to_chat
from app.proxy.forward import (
    StreamBroken,
    UpstreamFailure,
    downstream_headers,
    is_event_stream,
    sse_error_event,
)
from app.routing.usage import TAIL_BYTES

log = logging.getLogger("sluice.forward")

IDLE_SLACK = 0.1  # the idle deadline moves by idle x (1 + this) when it moves


@dataclass(slots=True)
class Relayed:
    broken: str | None  # None when the answer ended well, else what broke it
    tail: bytes  # the answer's last TAIL_BYTES, where its usage is


class IdleDeadline:
    """The relay's cancel scope, due `idle` to 1.1 x `idle` after the backend's last byte."""

    __slots__ = ("_idle", "_scope", "_step")

    def __init__(self, scope: trio.CancelScope, idle: float) -> None:
        self._scope = scope
        self._idle = idle
        self._step = idle * (1 + IDLE_SLACK)
        scope.deadline = trio.current_time() + self._step

    def data_arrived(self) -> None:
        now = trio.current_time()
        if self._scope.deadline - now < self._idle:
            self._scope.deadline = now + self._step

    def pause(self) -> None:
        self._scope.deadline = math.inf

    def resume(self) -> None:
        self._scope.deadline = trio.current_time() + self._step


class _Passage:
    """An answer's body on its way: each read decoded (and converted), its tail kept."""

    __slots__ = ("_converter", "_response", "tail")

    def __init__(self, response: UpstreamResponse, converter: ChatStreamConverter | None) -> None:
        self._response = response
        self._converter = converter
        self.tail = b""

    def take(self, raw: bytes) -> bytes:
        """The content of one read of the backend's socket."""
        return self._keep(self._response.decode(raw))

    def take_arrived(self) -> bytes:
        """The content that came with the response's head."""
        return self._keep(self._response.take_arrived())

    def _keep(self, data: bytes) -> bytes:
        if self._converter is not None:
            data = self._converter.feed(data)
        if data:
            self.tail = (self.tail + data)[-TAIL_BYTES:]
        return data

    def complete(self) -> bool:
        return self._response.complete

    def last(self, data: bytes) -> bytes:
        """The body's last content, and whatever the converter still held."""
        return data if self._converter is None else data + self._converter.finish()


async def relay(
    response: UpstreamResponse,
    exchange: Exchange,
    extra_headers: Headers,
    idle: float,
    converter: ChatStreamConverter | None = None,
    hub: RelayHub | None = None,
) -> Relayed:
    """Relay the response (through `converter` if given), its body by `hub` where both ends
    are sockets. `UpstreamFailure` if the body is broken before anything was sent."""
    headers = downstream_headers(response, extra_headers)
    passage = _Passage(response, converter)
    try:
        first = passage.take_arrived()
    except UpstreamError as exc:
        raise UpstreamFailure("protocol", str(exc)) from None
    if response.complete:
        await response.release()
        await exchange.start(response.status_code, headers, passage.last(first), complete=True)
        return Relayed(None, passage.tail)
    await exchange.start(response.status_code, headers, first, complete=False)
    stream = _hub_stream(hub, response, exchange, passage, idle)
    if hub is not None and stream is not None:
        ended = await hub.relay(stream)
    else:
        ended = await _pump(response, exchange, passage, idle)
    if ended.client_gone:
        raise ClientGone
    if ended.broken is not None:
        return await _broken_off(response, exchange, ended.broken, passage.tail)
    await response.release()
    await exchange.end(passage.last(ended.last))
    return Relayed(None, passage.tail)


def _hub_stream(
    hub: RelayHub | None,
    response: UpstreamResponse,
    exchange: Exchange,
    passage: _Passage,
    idle: float,
) -> HubStream | None:
    """The stream for `hub`, if it can take it: both ends sockets, a body it may frame."""
    if hub is None:
        return None
    upstream_fd = response.socket_fd()
    target = exchange.relay_target()
    if upstream_fd is None or target is None:
        return None
    client_fd, frame = target
    first_write = exchange.mark_first_byte if exchange.first_byte_at is None else None
    return HubStream(
        upstream_fd, client_fd, passage.take, passage.complete, frame, idle, first_write
    )


async def _pump(
    response: UpstreamResponse, exchange: Exchange, passage: _Passage, idle: float
) -> Ended:
    """The relay in the request's own task, for streams the hub cannot take."""
    with trio.CancelScope() as scope:
        deadline = IdleDeadline(scope, idle)
        exchange.client_wait = deadline
        try:
            while True:
                content = passage.take(await response.receive())
                deadline.data_arrived()
                if response.complete:
                    return Ended(last=content)
                if content:
                    await exchange.write(content)
        except UpstreamError as exc:
            return Ended(broken=str(exc))
        finally:
            exchange.client_wait = None
    return Ended(broken=f"no data from the backend for {idle:g}s")


async def _broken_off(
    response: UpstreamResponse, exchange: Exchange, detail: str, tail: bytes
) -> Relayed:
    if not is_event_stream(response):
        raise StreamBroken(detail)
    log.warning("stream broke: %s", detail)
    await exchange.end(sse_error_event(f"The backend stream broke: {detail}"))
    return Relayed(detail, tail)


async def relay_as_chat(
    response: UpstreamResponse,
    exchange: Exchange,
    extra_headers: Headers,
    idle: float,
    hub: RelayHub | None = None,
) -> Relayed:
    """Relay a backend's completion as a chat completion; errors (4xx/5xx) pass unchanged.

    A whole answer is read before anything is sent (it is small, and its length changes), so
    a failure while reading it raises `UpstreamFailure`: the client has nothing yet and the
    request can still be retried elsewhere.
    """
    if response.status_code != 200:
        return await relay(response, exchange, extra_headers, idle, hub=hub)
    if is_event_stream(response):
        return await relay(response, exchange, extra_headers, idle, ChatStreamConverter(), hub)
    pieces = []
    with trio.CancelScope() as scope:
        deadline = IdleDeadline(scope, idle)
        try:
            pieces.append(response.take_arrived())
            while not response.complete:
                pieces.append(response.decode(await response.receive()))
                deadline.data_arrived()
        except UpstreamError as exc:
            raise UpstreamFailure("protocol", f"the answer broke off: {exc}") from None
    if scope.cancelled_caught:
        raise UpstreamFailure("timeout", f"no data from the backend for {idle:g}s")
    await response.release()
    body = b"".join(pieces)
    try:
        converted = completion_to_chat(body)
    except ValueError as exc:
        detail = f"the backend's completion cannot be returned as a chat completion: {exc}"
        await exchange.respond_error(
            502, detail, "upstream_error", None, "backend_bad_response", extra_headers
        )
        return Relayed(detail, b"")
    headers = [
        (k, v) for k, v in downstream_headers(response, extra_headers) if k != b"content-length"
    ]
    await exchange.respond(200, headers, converted)
    return Relayed(None, converted[-TAIL_BYTES:])
