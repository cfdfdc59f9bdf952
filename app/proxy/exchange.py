"""One client connection (h11's server side) and the exchanges of request and answer on it.

Two tasks share a connection. A reader task (`ClientConnection.read`) is its only reader: it
feeds every byte to h11 and, when the client closes while an answer is still being made,
cancels that request at once, so a client that gives up stops its backend's work too. The
connection's own task pulls h11 events, runs the handler and writes the answer. One reader
for the connection's lifetime costs one wake-up per read; a watcher started per request
cost ~34 µs here (a nursery, a task, its cancellation).

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

import h11
import trio

from app.errors import ClientError, error_body
from app.proxy.body_framing import LAST_CHUNK, chunk
from app.proxy.byte_stream import ByteStream, SendWait

Headers = list[tuple[bytes, bytes]]

# Bytes of pipelined requests read ahead while an answer is being made; beyond, the reader
# waits (and a client leaving is noticed by the next write instead).
PIPELINE_READ_AHEAD = 65536
CLOSE = (b"connection", b"close")


class ClientGone(Exception):
    """The client closed the connection: its request cannot be read or answered."""


class ClientConnection:
    """h11's server side of one connection, shared by its two tasks (http_server.py).

    One task reads: it feeds every byte to h11 (`read_some`), and when the client closes
    while an answer is being made, it cancels that answer, so a client that gives up stops
    its backend's work too. The other task answers, or waits to read again (`idle`).
    """

    def __init__(self, stream: ByteStream, max_head_bytes: int) -> None:
        self.stream = stream
        self._max_head_bytes = max_head_bytes
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.peer_gone = False
        # The request being answered: cancelled when the client leaves.
        self.answering: trio.CancelScope | None = None
        # The reader's wait. Its deadline is the keep-alive or head timeout while nothing is
        # being answered, none while something is; the answer that ends sets it.
        self.reading: trio.CancelScope | None = None
        self.head_started: float | None = None  # when the next request's first byte came
        self._idle = trio.lowlevel.ParkingLot()  # the task that neither reads nor answers
        self._reading_handed_over = False
        self._arrived = trio.lowlevel.ParkingLot()  # an answer waiting for body bytes
        self._resume_reading = trio.lowlevel.ParkingLot()  # read-ahead used up
        self._read_ahead = 0

    async def read_some(self) -> None:
        """Feed h11 what has arrived, or the end of input, which cancels an answer in
        progress. While an answer is made, at most PIPELINE_READ_AHEAD bytes are read."""
        while self.answering is not None and self._read_ahead > PIPELINE_READ_AHEAD:
            await self._resume_reading.park()
        try:
            data = await self.stream.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if self.answering is not None and self.h11.their_state is h11.DONE:
            self._read_ahead += len(data)  # the next request's, read while answering
        self.h11.receive_data(data)
        self._arrived.unpark_all()
        if not data:
            self.peer_gone = True
            if self.answering is not None:
                self.answering.cancel()

    def hand_over_reading(self) -> None:
        """The task that read a request answers it: the other one reads meanwhile."""
        self._reading_handed_over = True
        self._idle.unpark_all()

    async def wait_to_read(self) -> None:
        """Until reading is handed over to this task, the idle one."""
        while not self._reading_handed_over:
            await self._idle.park()
        self._reading_handed_over = False

    async def next_event(
        self, deadline: float
    ) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
        """h11's next event for the answer, waiting for the reader to feed it bytes until
        `deadline` (trio.TooSlowError after)."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            with trio.fail_at(deadline):
                await self._arrived.park()

    def next_cycle(self) -> None:
        """The request was read and answered whole: parse the next one from what is left.
        (A fresh parser: h11 reads requests here, the answers are written by `Exchange`.)"""
        rest, closed = self.h11.trailing_data
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self._max_head_bytes)
        if rest:
            self.h11.receive_data(rest)
        if closed:
            self.h11.receive_data(b"")

    async def refuse(self, status: int, message: str, code: str) -> None:
        """An error answer to a request h11 could not read; the connection then closes."""
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            CLOSE,
        ]
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.stream.send(response_head(status, headers) + body)

    def begin_answering(self, scope: trio.CancelScope) -> None:
        self.answering = scope
        if self.peer_gone:
            scope.cancel()

    def end_answering(self, reading_deadline: float) -> None:
        """Nothing is being answered now: the reader may take the next request, and waits
        for it until `reading_deadline`."""
        self.answering = None
        self._read_ahead = 0
        self._resume_reading.unpark_all()
        if self.reading is not None:
            self.reading.deadline = reading_deadline


# Framings of an answer's body (Exchange._framing).
_NONE, _CHUNKED, _COUNTED, _UNTIL_CLOSE = range(4)


class Exchange:
    """One request and the answer to it."""

    __slots__ = (
        "_closing",
        "_connection",
        "_framing",
        "_read_timeout",
        "client_wait",
        "complete",
        "first_byte_at",
        "headers",
        "keep_alive",
        "method",
        "path",
        "status",
    )

    def __init__(
        self,
        connection: ClientConnection,
        request: h11.Request,
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
        self.headers: Headers = list(request.headers)  # names in lower case
        self.status: int | None = None  # once the answer's head went out
        self.first_byte_at: float | None = None  # perf_counter at the first body byte
        self.complete = False  # the answer's last byte went out
        # Whether the connection may carry another request after this one: HTTP/1.1 and no
        # `Connection: close` from the client (RFC 9112 §9.3), until the answer says otherwise.
        self.keep_alive = request.http_version == b"1.1" and not any(
            name == b"connection" and b"close" in value.lower() for name, value in self.headers
        )
        # Told when a write waits for a slow client (the relay's idle timeout pauses).
        self.client_wait: SendWait | None = None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def started(self) -> bool:
        return self.status is not None

    async def read_body(self, limit: int) -> bytes:
        """The whole request body. A 413 `ClientError` past `limit` bytes (before reading
        any when Content-Length says so), a 408 when the client stops sending for the read
        timeout, a 400 for a malformed body, `ClientGone` when the client left."""
        connection = self._connection
        protocol = connection.h11
        declared = self.header(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        if protocol.they_are_waiting_for_100_continue:
            await self._send(b"HTTP/1.1 100 Continue\r\n\r\n")
        pieces: list[bytes] = []
        size = 0
        while True:
            try:
                event = await connection.next_event(trio.current_time() + self._read_timeout)
            except trio.TooSlowError:
                raise ClientError(
                    f"The request body did not arrive within {self._read_timeout:g}s.",
                    code="request_timeout",
                    status=408,
                    headers=[CLOSE],
                ) from None
            except h11.RemoteProtocolError as exc:
                raise ClientError(
                    f"Malformed request body: {exc}", code="invalid_body", headers=[CLOSE]
                ) from None
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limit:
                    raise _too_large(limit)
                pieces.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(pieces)
            else:  # ConnectionClosed
                raise ClientGone

    def _head(self, status: int, headers: Headers, framing: int) -> bytes:
        protocol = self._connection.h11
        if protocol.their_state is h11.SEND_BODY:
            # Answered without reading the body: an empty one ends here and the connection
            # stays open; data is dropped, and the connection closes.
            protocol.next_event()
        if (
            not self.keep_alive
            or framing == _UNTIL_CLOSE
            or self._closing()
            or protocol.their_state is not h11.DONE
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
        elif any(name == b"content-length" for name, _ in headers):
            framing = _COUNTED
        elif self._connection.h11.their_http_version == b"1.1":
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
    parser that validated them (h11's for the client's, upstream_protocol.py's for a
    backend's)."""
    lines = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b""))]
    lines.extend(b"%b: %b\r\n" % pair for pair in headers)
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
