"""Forwarding to one backend: open the upstream response, then relay it byte for byte.

Opening is where a failure can still be retried elsewhere (nothing has reached the client);
relaying is where it can't, so a broken stream ends with an SSE error event instead.
`relay_as_chat` is the relay for `--forward tokens` chat requests: the backend answered a
completion, the client gets a chat completion (chat_conversion.py does the reshaping).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import trio

from app.asgi import Headers, Send, send_error
from app.errors import error_body
from app.proxy.chat_conversion import ChatStreamConverter, completion_to_chat
from app.proxy.upstream import UpstreamError, UpstreamPool, UpstreamResponse

log = logging.getLogger("sluice.forward")

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
NOT_FORWARDED_UPSTREAM = HOP_BY_HOP | {b"host", b"content-length"}
NOT_RELAYED_DOWNSTREAM = HOP_BY_HOP | {b"content-length", b"date"}


class UpstreamFailure(Exception):
    """The backend failed before answering: nothing reached the client yet."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind  # "connect" | "timeout" | "protocol"
        self.detail = detail


class StreamBroken(Exception):
    """The backend failed after the response started; the connection must be dropped."""


@dataclass(frozen=True)
class Timeouts:
    first_byte: float
    idle: float


def upstream_headers(client_headers: Headers, request_id: bytes) -> Headers:
    """The client's headers minus hop-by-hop ones, with the request id the proxy settled on."""
    kept = [
        (k, v)
        for k, v in client_headers
        if k not in NOT_FORWARDED_UPSTREAM and k != b"x-request-id"
    ]
    kept.append((b"x-request-id", request_id))
    return kept


def _connection_tokens(response: UpstreamResponse) -> set[bytes]:
    """Headers named in `Connection:` are hop-by-hop too (RFC 9110 §7.6.1)."""
    value = response.header(b"connection") or b""
    return {token.strip().lower() for token in value.split(b",") if token.strip()}


def downstream_headers(response: UpstreamResponse, extra: Headers) -> Headers:
    named = _connection_tokens(response)
    relayed = [
        (k, v) for k, v in response.headers if k not in NOT_RELAYED_DOWNSTREAM and k not in named
    ]
    if not is_event_stream(response):
        length = response.header(b"content-length")
        if length is not None:
            relayed.append((b"content-length", length))
    return relayed + extra


def is_event_stream(response: UpstreamResponse) -> bool:
    return (response.header(b"content-type") or b"").startswith(b"text/event-stream")


async def open_upstream(
    pool: UpstreamPool,
    base_url: str,
    path: str,
    body: bytes,
    headers: Headers,
    timeouts: Timeouts,
) -> UpstreamResponse:
    """Send the request and wait for the response head, within the first-byte timeout."""
    try:
        with trio.fail_after(timeouts.first_byte):
            return await pool.request(base_url, path, headers, body)
    except trio.TooSlowError:
        raise UpstreamFailure("timeout", f"no response within {timeouts.first_byte:g}s") from None
    except UpstreamError as exc:
        raise UpstreamFailure("connect" if exc.connect else "protocol", str(exc)) from None


async def _chunks(response: UpstreamResponse, idle: float) -> AsyncGenerator[bytes, None]:
    """The body as it arrives, failing if the backend goes quiet for `idle` seconds.

    Only the wait for the backend is timed: a client slow to take a chunk holds the stream
    (that is back-pressure, not a silent backend), and no cancel scope may span the `yield`.
    """
    while True:
        with trio.move_on_after(idle) as waited:
            chunk = await response.receive_chunk()
        if waited.cancelled_caught:
            raise UpstreamError(f"no data from the backend for {idle:g}s")
        if chunk is None:
            return
        yield chunk


def sse_error_event(message: str) -> bytes:
    payload = error_body(message, "upstream_error", None, "backend_stream_broken")
    return b"data: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"


async def relay(
    response: UpstreamResponse,
    send: Send,
    extra_headers: Headers,
    idle: float,
    converter: ChatStreamConverter | None = None,
) -> str | None:
    """Relay the response (through `converter` if given); return None when it ended well,
    else what broke it.

    On a mid-stream failure an event stream gets an error event and a clean end; any other
    body raises `StreamBroken` so the server drops the connection rather than let a
    truncated JSON document look complete.
    """
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": downstream_headers(response, extra_headers),
        }
    )
    sent = 0
    finished = False
    try:
        # Closed on the way out: the request is cancelled as its last byte goes out, and
        # a generator left suspended would be finalized later, in a task of its own.
        async with aclosing(_chunks(response, idle)) as chunks:
            async for received in chunks:
                chunk = received if converter is None else converter.feed(received)
                if chunk:
                    # A body already read to its end goes out as the last message.
                    finished = converter is None and await response.ended()
                    await send(
                        {"type": "http.response.body", "body": chunk, "more_body": not finished}
                    )
                    sent += len(chunk)
    except UpstreamError as exc:
        detail = str(exc)
        if not is_event_stream(response):
            raise StreamBroken(detail) from exc
        log.warning("stream broke after %d bytes: %s", sent, detail)
        await send(
            {
                "type": "http.response.body",
                "body": sse_error_event(f"The backend stream broke: {detail}"),
                "more_body": False,
            }
        )
        return detail
    if not finished:
        tail = b"" if converter is None else converter.finish()
        await send({"type": "http.response.body", "body": tail, "more_body": False})
    return None


async def relay_as_chat(
    response: UpstreamResponse,
    send: Send,
    extra_headers: Headers,
    idle: float,
) -> str | None:
    """Relay a backend's completion as a chat completion; errors (4xx/5xx) pass unchanged.

    A whole answer is read before anything is sent (it is small, and its length changes), so
    a failure while reading it raises `UpstreamFailure`: the client has nothing yet and the
    request can still be retried elsewhere.
    """
    if response.status_code != 200:
        return await relay(response, send, extra_headers, idle)
    if is_event_stream(response):
        return await relay(response, send, extra_headers, idle, ChatStreamConverter())
    try:
        body = b"".join([chunk async for chunk in _chunks(response, idle)])
    except UpstreamError as exc:
        raise UpstreamFailure("protocol", f"the answer broke off: {exc}") from None
    try:
        converted = completion_to_chat(body)
    except ValueError as exc:
        detail = f"the backend's completion cannot be returned as a chat completion: {exc}"
        await send_error(
            send, 502, detail, "upstream_error", None, "backend_bad_response", extra_headers
        )
        return detail
    headers = [
        (k, v) for k, v in downstream_headers(response, extra_headers) if k != b"content-length"
    ]
    headers.append((b"content-length", str(len(converted)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": converted, "more_body": False})
    return None
