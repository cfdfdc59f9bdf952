"""Relaying a backend's answer to the client as it arrives: the proxy's per-token hot path.

Per read of the backend's socket: decode its framing (body_framing.py), keep the answer's
tail, write what arrived to the client in one frame and one `send`. Whatever arrived
between two reads goes out together, so a busy proxy coalesces tokens and an idle one adds
no delay. Nothing else runs per token: usage, `cached_tokens` and the finish reason are
read from the tail once the answer has ended (routing/usage.py), the request's trace reads
the exchange's first-byte time once, and there is no per-chunk metric.

A backend silent for `idle` seconds ends the relay. The timeout is one cancel scope whose
deadline moves forward only when it comes within `idle` of now (by `idle` and a tenth), so
a stream pays a clock read per token, not a deadline change; it fires between `idle` and
1.1 x `idle` after the last byte. A client slow to take the answer is back-pressure, not a
silent backend: the deadline is lifted while a write waits for the client.

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

from app.proxy.chat_conversion import ChatStreamConverter, completion_to_chat
from app.proxy.exchange import Exchange, Headers
from app.proxy.forward import (
    StreamBroken,
    UpstreamFailure,
    downstream_headers,
    is_event_stream,
    sse_error_event,
)
from app.proxy.upstream import UpstreamError, UpstreamResponse
from app.routing.usage import TAIL_BYTES

log = logging.getLogger("sluice.forward")

IDLE_SLACK = 0.1  # the idle deadline moves by idle x (1 + this) when it moves


@dataclass(frozen=True)
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


async def relay(
    response: UpstreamResponse,
    exchange: Exchange,
    extra_headers: Headers,
    idle: float,
    converter: ChatStreamConverter | None = None,
) -> Relayed:
    """Relay the response (through `converter` if given)."""
    headers = downstream_headers(response, extra_headers)
    tail = b""
    with trio.CancelScope() as scope:
        deadline = IdleDeadline(scope, idle)
        exchange.client_wait = deadline
        try:
            first = await response.read_arrived()
            if converter is not None:
                first = converter.feed(first)
            tail = first[-TAIL_BYTES:]
            if response.ended:
                last = _last(first, converter)
                await exchange.start(response.status_code, headers, last, complete=True)
                return Relayed(None, tail)
            await exchange.start(response.status_code, headers, first, complete=False)
            while (data := await response.read()) is not None:
                deadline.data_arrived()
                if converter is not None:
                    data = converter.feed(data)
                tail = (tail + data)[-TAIL_BYTES:]
                if response.ended:
                    await exchange.end(_last(data, converter))
                    return Relayed(None, tail)
                if data:
                    await exchange.write(data)
            await exchange.end(_last(b"", converter))
            return Relayed(None, tail)
        except UpstreamError as exc:
            broken = str(exc)
        finally:
            exchange.client_wait = None
    if scope.cancelled_caught:
        broken = f"no data from the backend for {idle:g}s"
    return await _broken_off(response, exchange, broken, tail)


def _last(data: bytes, converter: ChatStreamConverter | None) -> bytes:
    return data if converter is None else data + converter.finish()


async def _broken_off(
    response: UpstreamResponse, exchange: Exchange, detail: str, tail: bytes
) -> Relayed:
    if not is_event_stream(response):
        raise StreamBroken(detail)
    log.warning("stream broke: %s", detail)
    await exchange.end(sse_error_event(f"The backend stream broke: {detail}"))
    return Relayed(detail, tail)


async def relay_as_chat(
    response: UpstreamResponse, exchange: Exchange, extra_headers: Headers, idle: float
) -> Relayed:
    """Relay a backend's completion as a chat completion; errors (4xx/5xx) pass unchanged.

    A whole answer is read before anything is sent (it is small, and its length changes), so
    a failure while reading it raises `UpstreamFailure`: the client has nothing yet and the
    request can still be retried elsewhere.
    """
    if response.status_code != 200:
        return await relay(response, exchange, extra_headers, idle)
    if is_event_stream(response):
        return await relay(response, exchange, extra_headers, idle, ChatStreamConverter())
    pieces = []
    with trio.CancelScope() as scope:
        deadline = IdleDeadline(scope, idle)
        try:
            pieces.append(await response.read_arrived())
            while (data := await response.read()) is not None:
                deadline.data_arrived()
                pieces.append(data)
        except UpstreamError as exc:
            raise UpstreamFailure("protocol", f"the answer broke off: {exc}") from None
    if scope.cancelled_caught:
        raise UpstreamFailure("timeout", f"no data from the backend for {idle:g}s")
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
