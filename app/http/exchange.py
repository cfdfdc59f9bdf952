"""One client connection (the server side) and the exchanges of request and answer on it.

One task serves a connection: it reads a request's head and body (request_head.py,
body_framing.py), runs the handler, writes the answer and reads the next request. While it
answers, a client that leaves is noticed by the server's one departure watcher
(departures.py), which cancels the answer so that its backend stops working too. A second
task per connection, reading while the first answered, did that for a wake-up per request.

What a handler sees is an `Exchange`: the request line and headers, `read_body` (bounded,
with `Expect: 100-continue` answered and a read timeout), and one of two ways to answer:
`respond` (a whole body) or `start` / `write` / `end` (a body relayed as it arrives:
chunked to HTTP/1.1 clients, with `Content-Length` when the backend gave one, until close to
HTTP/1.0 clients). `write` is the relay's hot path: one frame and one `send` per call.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any

import trio

from app.http.departures import Departures
from app.http.errors import ClientError, error_body
from app.http.fields import Headers, field, field_lines, first_values
from app.http.framing import LAST_CHUNK, BodyDecoder, FramingError, chunk
from app.http.request_head import HeadReader, RequestHead
from app.http.streams import ByteStream, SendWait

CLOSE = (b"connection", b"close")


class ClientGone(Exception):
    """The client closed the connection: its request cannot be read or answered."""


class ClientConnection:
    """The server side of one connection, served by one task (http_server.py).

    The task reads a request's head and body into the unread buffer (`read_some`), answers
    it, and reads the next; what a client pipelines meanwhile waits in the kernel.
    `departures` watches the socket: a client that leaves cancels the connection's scope
    (`ended`), an answer in progress with it, so its backend stops working too.
    """

    def __init__(
        self,
        stream: ByteStream,
        max_head_bytes: int,
        now: float,
        departures: Departures | None = None,
    ) -> None:
        self.stream = stream
        self.unread = b""
        self._heads = HeadReader(max_head_bytes)
        # The body of the request being answered; None between requests.
        self._body: BodyDecoder | None = None
        self.continue_expected = False  # the client waits for 100 Continue before its body
        self.peer_gone = False
        self.answering = False  # a request is being answered
        # The connection's scope (http_server.py sets it): cancelled when the client leaves
        # while its request is being answered, which ends the answer and the connection.
        self.ended: trio.CancelScope | None = None
        self._departures = departures
        self._watched: int | None = None  # the socket `departures` watches
        # What the connection's timer (http_server.py) expires it by: when it last went
        # idle, when the first byte of a head still unfinished came, and the timer's sleep.
        self.idle_since = now
        self.head_started: float | None = None
        self.timer: trio.CancelScope | None = None

    async def read_some(self) -> None:
        """Append what has arrived to `unread`, or note the end of input (`peer_gone`)."""
        try:
            data = await self.stream.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if data:
            self.unread += data
        else:
            self.peer_gone = True

    def next_request(self) -> RequestHead | None:
        """The next request's head once `unread` holds it whole, else None. Raises a
        `ClientError` for a head that is not HTTP/1.1; the connection must then close."""
        head, taken = self._heads.parse(self.unread)
        if taken:
            self.unread = self.unread[taken:]
        if head is not None:
            self.head_started = None
            self._body = head.body_decoder()
            self.continue_expected = (
                head.expects_continue and not self._body.done and not self.unread
            )
        return head

    @property
    def request_read(self) -> bool:
        """Whether the request being answered was read to the end of its body."""
        return self._body is None or self._body.done

    def take_body(self) -> list[bytes]:
        """The body bytes `unread` holds for the request being answered (FramingError for a
        malformed chunked body); what follows its end stays unread."""
        body = self._body
        if body is None or body.done or not self.unread:
            return []
        self.continue_expected = False
        pieces = body.feed(self.unread)
        self.unread = body.leftover
        body.leftover = b""
        return pieces

    def next_cycle(self) -> None:
        """The request was read and answered whole: the next one starts at `unread`."""
        self._body = None

    async def refuse(self, error: ClientError) -> None:
        """An error answer to a request that could not be read; the connection then closes."""
        body = json.dumps(error.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            CLOSE,
        ]
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.stream.send(response_head(error.status, headers) + body)

    def start_watching(self, ended: trio.CancelScope) -> None:
        """The connection's scope, which `departures` cancels if the client leaves, answered
        or idle: its socket is watched for its whole life, not request by request (two
        system calls a request were 4% of the proxy's samples)."""
        self.ended = ended
        fd = self.stream.socket_fd()
        if fd is not None and self._departures is not None:
            self._departures.watch(fd, ended)
            self._watched = fd

    def stop_watching(self) -> None:
        """No more departures watched for this connection: before its socket closes."""
        if self._watched is not None and self._departures is not None:
            self._departures.forget(self._watched)
            self._watched = None

    def begin_answering(self) -> None:
        self.answering = True
        if self.peer_gone and self.ended is not None:
            self.ended.cancel()

    def end_answering(self, now: float) -> None:
        """Nothing is being answered now: the connection is idle from `now` (part of the
        next head may already be here)."""
        self.answering = False
        self.idle_since = now
        if self.unread:
            self.head_started = now


# Framings of an answer's body (Exchange._framing).
_NONE, _CHUNKED, _COUNTED, _UNTIL_CLOSE = range(4)


class Exchange:
    """One request and the answer to it."""

    __slots__ = (
        "_closing",
        "_connection",
        "_first_values",
        "_framing",
        "_read_timeout",
        "client_wait",
        "complete",
        "first_byte_at",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "path",
        "status",
    )

    def __init__(
        self,
        connection: ClientConnection,
        request: RequestHead,
        *,
        read_timeout: float,
        closing: Callable[[], bool],
    ) -> None:
        self._connection = connection
        self._read_timeout = read_timeout
        self._closing = closing  # whether the server is shutting down: then it is the last
        self._framing = _NONE
        self.method = request.method.decode("ascii")
        self.path = request.target.partition(b"?")[0].decode("latin-1")
        self.http_version = request.http_version
        self.headers: Headers = request.headers  # names in lower case
        self._first_values = first_values(request.headers)
        self.status: int | None = None  # once the answer's head went out
        self.first_byte_at: float | None = None  # perf_counter at the first body byte
        self.complete = False  # the answer's last byte went out
        # Whether the connection may carry another request after this one, until the answer
        # says otherwise.
        self.keep_alive = request.keep_alive
        # Told when a write waits for a slow client (the relay's idle timeout pauses).
        self.client_wait: SendWait | None = None

    def header(self, name: bytes) -> bytes | None:
        return self._first_values.get(name)

    @property
    def started(self) -> bool:
        return self.status is not None

    async def read_body(self, limit: int) -> bytes:
        """The whole request body. A 413 `ClientError` past `limit` bytes (before reading
        any when Content-Length says so), a 408 when the client stops sending for the read
        timeout, a 400 for a malformed body, `ClientGone` when the client left."""
        connection = self._connection
        declared = self.header(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        if connection.continue_expected:
            await self._send(b"HTTP/1.1 100 Continue\r\n\r\n")
        pieces: list[bytes] = []
        size = 0
        while True:
            try:
                arrived = connection.take_body()
            except FramingError as exc:
                raise ClientError(
                    f"Malformed request body: {exc}", code="invalid_body", headers=[CLOSE]
                ) from None
            for piece in arrived:
                size += len(piece)
                if size > limit:
                    raise _too_large(limit)
                pieces.append(piece)
            if connection.request_read:
                return b"".join(pieces)
            if connection.peer_gone:
                raise ClientGone
            try:
                with trio.fail_after(self._read_timeout):
                    await connection.read_some()
            except trio.TooSlowError:
                raise ClientError(
                    f"The request body did not arrive within {self._read_timeout:g}s.",
                    code="request_timeout",
                    status=408,
                    headers=[CLOSE],
                ) from None

    def _head(self, status: int, headers: Headers, framing: int) -> bytes:
        connection = self._connection
        if not connection.request_read:
            # Answered without reading the body: what has arrived of it is dropped, and
            # unless that was all of it, the connection ends with this answer.
            with contextlib.suppress(FramingError):
                connection.take_body()
        if (
            not self.keep_alive
            or framing == _UNTIL_CLOSE
            or self._closing()
            or not connection.request_read
            or CLOSE in headers
        ):
            # The client asked, the body runs until close, the server is shutting down or
            # the request's body was left unread: this connection ends with this answer.
            self.keep_alive = False
            if CLOSE not in headers:
                headers = [*headers, CLOSE]
        if framing == _CHUNKED:
            headers = [*headers, (b"transfer-encoding", b"chunked")]
        self._framing = framing
        self.status = status
        return response_head(status, headers)

    async def respond(
        self, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """A whole answer in one write; `headers` should not frame it (Content-Length is set)."""
        framed = [*headers, (b"content-length", b"%d" % len(body))]
        payload = self._head(status, framed, _COUNTED)
        if self.method != "HEAD":
            payload += body
        self.first_byte_at = time.perf_counter()
        await self._send(payload)
        self.complete = True

    async def respond_json(
        self, status: int, payload: Any, headers: Iterable[tuple[bytes, bytes]] = ()
    ) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        await self.respond(status, [(b"content-type", b"application/json"), *headers], body)

    async def respond_error(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | int | None = None,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        await self.respond_json(status, error_body(message, type_, param, code), headers)

    async def respond_client_error(self, error: ClientError) -> None:
        await self.respond_json(error.status, error.body(), error.headers)

    async def start(
        self, status: int, headers: Headers, first: bytes = b"", *, complete: bool
    ) -> None:
        """The head of an answer and `first` of its body in one write; the rest follows
        by `write` and `end`, unless `complete`: then `first` was all of it. `headers`
        frame the body with Content-Length, or else it is chunked (until close for an
        HTTP/1.0 client)."""
        if self.method == "HEAD":
            framing = _NONE
        elif field(headers, b"content-length") is not None:
            framing = _COUNTED
        elif self.http_version == b"1.1":
            framing = _CHUNKED
        else:
            framing = _UNTIL_CLOSE
        head = self._head(status, headers, framing)
        if first:
            head += self._frame(first)
            self.first_byte_at = time.perf_counter()
        if complete:
            head += self._ending()
        await self._send(head)
        self.complete = complete

    def relay_target(self) -> tuple[int, Callable[[bytes], bytes]] | None:
        """For the relay hub, which writes the body itself: the client socket's descriptor
        and how a piece of the body is framed; None where writes must go through `write`
        (not a socket; an answer to HEAD, which has no body)."""
        fd = self._connection.stream.socket_fd()
        if fd is None or self._framing == _NONE:
            return None
        return fd, (chunk if self._framing == _CHUNKED else _as_is)

    def mark_first_byte(self) -> None:
        self.first_byte_at = time.perf_counter()

    def _frame(self, data: bytes) -> bytes:
        if self._framing == _CHUNKED:
            return chunk(data)
        return data if self._framing != _NONE else b""

    def _ending(self) -> bytes:
        return LAST_CHUNK if self._framing == _CHUNKED else b""

    async def write(self, data: bytes) -> None:
        """More of the body; `data` must not be empty. The relay's per-token call."""
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()
        try:
            await self._connection.stream.send(self._frame(data), self.client_wait)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ClientGone from None

    async def end(self, last: bytes = b"") -> None:
        """The rest of the body, if any, and its end, in one write."""
        payload = self._frame(last) if last else b""
        if last and self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()
        payload += self._ending()
        if payload:
            await self._send(payload)
        self.complete = True

    async def _send(self, payload: bytes) -> None:
        try:
            await self._connection.stream.send(payload, self.client_wait)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ClientGone from None


def _as_is(data: bytes) -> bytes:
    return data


def response_head(status: int, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """Status line and header lines; names and values are the proxy's own or came through a
    parser that validated them (header_fields.py, for a client's and a backend's alike)."""
    lines = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b""))]
    lines += field_lines(headers)
    lines.append(b"\r\n")
    return b"".join(lines)


_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


def _too_large(limit: int) -> ClientError:
    # The rest of the body stays unread, so the connection must close; saying so keeps a
    # keep-alive client from sending its next request into it.
    return ClientError(
        f"The request body is larger than {limit} bytes.",
        code="request_too_large",
        status=413,
        headers=[CLOSE],
    )
