"""Relaying a backend's answer to the client as it arrives: the proxy's per-token hot path.

The request's task sends the head and whatever body came with it, then hands the body's rest
to the relay hub (app/http/relay_hub.py), one task for every stream, and parks until it has
ended. The hub calls `_Passage.take` once per read of the backend (decode the framing, convert
for `--forward tokens`, keep the tail) and writes what one read brought in one frame and one
write: whatever arrived between two reads goes out together, so a busy proxy coalesces tokens
and an idle one adds no delay. A backend silent for `idle` seconds ends the stream (the
hub's sweep); a client slow to take the answer is back-pressure, not a silent backend.
Nothing else runs per token: usage, `cached_tokens` and the finish reason are read from the
tail once the answer has ended (routing/usage.py), the request's trace reads the exchange's
first-byte time once, and there is no per-chunk metric.

On a failure mid-answer an event stream the engine had finished (its API's end marker is in
the tail: endpoints.py) ends cleanly, counted as untidy; one cut before its end gets its API's
error event and a clean end; any other body raises `StreamBroken`, so the server drops the
connection rather than let a truncated JSON document look complete. A `Converter` may rewrite
what passes (a stored response's id, the chat shape for `--forward tokens`). `relay_as_chat`
is the relay for `--forward tokens` chat requests: the backend answered a completion, the
client gets a chat completion (chat_conversion.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from app.http.client import UpstreamError, UpstreamResponse
from app.http.exchange import ClientGone, Exchange
from app.http.fields import Headers
from app.http.relay_hub import HubStream, RelayHub
from app.preprocess.endpoints import CHAT, Endpoint
from app.proxy.chat_conversion import ChatStreamConverter, completion_to_chat
from app.proxy.forward import (
    StreamBroken,
    UpstreamFailure,
    downstream_headers,
    is_event_stream,
)
from app.routing.usage import TAIL_BYTES

log = logging.getLogger("sluice.forward")


class Converter(Protocol):
    """Rewrites an answer's body as it passes, read by read."""

    def feed(self, data: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


@dataclass(slots=True)
class Relayed:
    broken: str | None  # None when the answer ended well, else what broke it
    tail: bytes  # the answer's last TAIL_BYTES, where its usage is
    untidy: bool = False  # cut after its engine had finished it: ended cleanly all the same


class _Passage:
    """An answer's body on its way: each read decoded (and converted), its tail kept."""

    __slots__ = ("_converter", "_response", "tail")

    def __init__(self, response: UpstreamResponse, converter: Converter | None) -> None:
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
        """The body's last content (converted already), and what the converter still held."""
        if self._converter is None:
            return data
        held = self._converter.finish()
        if held:
            self.tail = (self.tail + held)[-TAIL_BYTES:]
        return data + held


async def relay(
    response: UpstreamResponse,
    exchange: Exchange,
    extra_headers: Headers,
    idle: float,
    hub: RelayHub,
    converter: Converter | None = None,
    endpoint: Endpoint = CHAT,
    *,
    started: Callable[[], None] = lambda: None,
) -> Relayed:
    """Relay the response (through `converter` if given), its body's middle by `hub`;
    `started()` when its body's first bytes come (the engine runs the request).
    `UpstreamFailure` if the body is broken before anything was sent."""
    headers = downstream_headers(response, extra_headers)
    if converter is not None:  # it changes the body's length: chunked, unless all is here
        headers = [(name, value) for name, value in headers if name != b"content-length"]
    passage = _Passage(response, converter)
    try:
        first = passage.take_arrived()
    except UpstreamError as exc:
        raise UpstreamFailure("protocol", str(exc)) from None
    if response.complete:
        await response.release()
        body = passage.last(first)
        if converter is not None:
            headers.append((b"content-length", b"%d" % len(body)))
        await exchange.start(response.status_code, headers, body, complete=True)
        return Relayed(None, passage.tail)
    await exchange.start(response.status_code, headers, first, complete=False)
    first_write = exchange.mark_first_byte
    if first:
        started()
    else:
        first_write = _then(exchange.mark_first_byte, started)
    sink = exchange.relay_sink()
    if sink is None:  # an answer to HEAD: no body goes out, so none is read
        await response.release()
        await exchange.end()
        return Relayed(None, passage.tail)
    client, frame = sink
    stream = HubStream(
        response.stream,
        client,
        passage.take,
        passage.complete,
        frame,
        idle,
        first_write,
    )
    ended = await hub.relay(stream)
    if ended.client_gone:
        raise ClientGone
    if ended.broken is not None:
        return await _broken_off(response, exchange, ended.broken, passage, endpoint)
    await response.release()
    await exchange.end(passage.last(ended.last))
    return Relayed(None, passage.tail)


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


async def _broken_off(
    response: UpstreamResponse,
    exchange: Exchange,
    detail: str,
    passage: _Passage,
    endpoint: Endpoint,
) -> Relayed:
    if not is_event_stream(response):
        raise StreamBroken(detail)
    rest = passage.last(b"")
    if endpoint.finished_in(passage.tail):
        log.info("stream cut after its end (%s): ended cleanly", detail)
        await exchange.end(rest)
        return Relayed(None, passage.tail, untidy=True)
    log.warning("stream broke: %s", detail)
    await exchange.end(rest + endpoint.broken(f"The backend stream broke: {detail}"))
    return Relayed(detail, passage.tail)


async def relay_as_chat(
    response: UpstreamResponse,
    exchange: Exchange,
    extra_headers: Headers,
    idle: float,
    hub: RelayHub,
    *,
    started: Callable[[], None] = lambda: None,
) -> Relayed:
    """Relay a backend's completion as a chat completion; errors (4xx/5xx) pass unchanged.

    A whole answer is read before anything is sent (it is small, and its length changes), so
    a failure while reading it raises `UpstreamFailure`: the client has nothing yet and the
    request can still be retried elsewhere.
    """
    if response.status_code != 200:
        return await relay(response, exchange, extra_headers, idle, hub, started=started)
    if is_event_stream(response):
        converter = ChatStreamConverter()
        return await relay(response, exchange, extra_headers, idle, hub, converter, started=started)
    try:
        body = await response.read_rest(idle)
    except UpstreamError as exc:
        if exc.timeout:
            raise UpstreamFailure("timeout", str(exc)) from None
        raise UpstreamFailure("protocol", f"the answer broke off: {exc}") from None
    await response.release()
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
