"""One request on a client connection and the answer to it: what a handler sees.

The request line and headers; `read_body` (bounded, with `Expect: 100-continue` answered and
a read timeout); and the answer: `send` writes a `Reply` (reply.py) in one call, its body
whole or relayed by the relay hub as it arrives from its source; `respond`, `start` / `write`
/ `end` are its parts (a body sent as it is made: chunked to HTTP/1.1 clients, with
`Content-Length` when the handler gives one, until close to HTTP/1.0 clients). `at_end`, if
the handler sets it, is called once the server is done with the exchange, however it ended.
Whether the connection may carry another request after this answer is the connection's to
say (connection.py, which does no I/O): the exchange reads and writes the connection's
stream, and reports what the answer implies (`Connection: close`, a body framed until close,
a request body left unread).
"""

from __future__ import annotations

import contextlib
import enum
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import trio

from app.errors import ClientError, WireError, answer_for
from app.http.connection import CLOSE, ClientConnection, response_head
from app.http.fields import Headers, field, first_values
from app.http.framing import LAST_CHUNK, FramingError, chunk
from app.http.relay_hub import HubStream
from app.http.reply import Reply
from app.http.request_head import RequestHead
from app.http.streams import ByteStream

KEEP_ALIVE = (b"connection", b"keep-alive")


class ClientGone(WireError):
    """The client closed the connection: its request cannot be read or answered."""


class Framing(enum.Enum):
    """How an answer's body is framed for its client."""

    NONE = "no body: the answer to HEAD"
    COUNTED = "Content-Length"
    CHUNKED = "chunked"
    UNTIL_CLOSE = "until the connection closes: HTTP/1.0"


NONE, COUNTED, CHUNKED, UNTIL_CLOSE = Framing


async def read_into(connection: ClientConnection, stream: ByteStream) -> None:
    """Hand the connection what has arrived; a connection broken or closed is the end of
    its input, as a client's close is."""
    try:
        data = await stream.receive()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        data = b""
    connection.receive(data)


class Exchange:
    """One request and the answer to it."""

    __slots__ = (
        "_connection",
        "_first_values",
        "_framing",
        "_stream",
        "at_end",
        "complete",
        "first_byte_at",
        "headers",
        "http_version",
        "method",
        "path",
        "status",
        "target",
    )

    def __init__(
        self, connection: ClientConnection, stream: ByteStream, request: RequestHead
    ) -> None:
        self._connection = connection
        self._stream = stream
        self._framing = NONE
        self.method = request.method.decode("ascii")
        self.path = request.path
        self.target = request.target  # as sent, with its query
        self.http_version = request.http_version
        self.headers: Headers = request.headers  # names in lower case
        self._first_values = first_values(request.headers)
        self.status: int | None = None  # once the answer's head went out
        self.first_byte_at: float | None = None  # perf_counter at the first body byte
        self.complete = False  # the answer's last byte went out
        self.at_end: Callable[[Exchange], None] | None = None

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
        reply = connection.continue_reply()
        if reply:
            await self._send(reply)
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
            if connection.input_ended:
                raise ClientGone
            timeout = connection.read_timeout
            try:
                with trio.fail_after(timeout):
                    await read_into(connection, self._stream)
            except trio.TooSlowError:
                raise ClientError(
                    f"The request body did not arrive within {timeout:g}s.",
                    code="request_timeout",
                    status=408,
                    headers=[CLOSE],
                ) from None

    def _head(self, status: int, headers: Headers, framing: Framing) -> bytes:
        connection = self._connection
        if not connection.request_read:
            # Answered without reading the body: what has arrived of it is dropped, and
            # unless that was all of it, the connection ends with this answer.
            with contextlib.suppress(FramingError):
                connection.take_body()
        if framing is UNTIL_CLOSE or not connection.request_read or CLOSE in headers:
            connection.must_close()
        if connection.last_answer:
            if CLOSE not in headers:
                headers = [*headers, CLOSE]
        elif self.http_version == b"1.0":
            headers = [*headers, KEEP_ALIVE]  # HTTP/1.0 closes unless told otherwise
        if framing is CHUNKED:
            headers = [*headers, (b"transfer-encoding", b"chunked")]
        self._framing = framing
        self.status = status
        return response_head(status, headers)

    async def respond(
        self, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """A whole answer in one write; `headers` should not frame it (Content-Length is set)."""
        framed = [*headers, (b"content-length", b"%d" % len(body))]
        payload = self._head(status, framed, COUNTED)
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

    async def respond_error(self, error: BaseException) -> None:
        """`error` answered as app/errors.py says (a 500 for anything not Sluice's own)."""
        answer = answer_for(error)
        await self.respond_json(answer.status, answer.body, answer.headers)

    async def send(self, reply: Reply) -> None:
        """Answer with `reply`: whole, or its head and first bytes in one write and the rest
        relayed by its source's hub as it arrives. A body that breaks off ends as the source
        says, or not at all (the connection then closes: `complete` stays False)."""
        source = reply.source
        await self.start(reply.status, reply.headers, reply.body, complete=source is None)
        if source is None:
            return
        first_write = self.mark_first_byte
        if reply.body:
            source.started()
        else:
            first_write = _both(self.mark_first_byte, source.started)
        sink = self.relay_sink()
        if sink is None:  # an answer to HEAD: no body goes out, so none is read
            await source.release()
            await self.end()
            return
        client, frame = sink
        stream = HubStream(
            source.stream, client, source.take, source.complete, frame, source.idle, first_write
        )
        ended = await source.hub.relay(stream)
        if ended.client_gone:
            raise ClientGone
        if ended.broken is not None:
            ending = source.broken(ended.broken)
            if ending is not None:
                await self.end(ending)
            return
        await source.release()
        await self.end(source.last(ended.last))

    async def start(
        self, status: int, headers: Headers, first: bytes = b"", *, complete: bool
    ) -> None:
        """The head of an answer and `first` of its body in one write; the rest follows
        by `write` and `end`, unless `complete`: then `first` was all of it. `headers`
        frame the body with Content-Length, or else it is chunked (until close for an
        HTTP/1.0 client)."""
        if self.method == "HEAD":
            framing = NONE
        elif field(headers, b"content-length") is not None:
            framing = COUNTED
        elif self.http_version == b"1.1":
            framing = CHUNKED
        else:
            framing = UNTIL_CLOSE
        head = self._head(status, headers, framing)
        if first:
            head += self._frame(first)
            self.first_byte_at = time.perf_counter()
        if complete:
            head += self._ending()
        await self._send(head)
        self.complete = complete

    def relay_sink(self) -> tuple[ByteStream, Callable[[bytes], bytes]] | None:
        """For the relay hub, which writes the body's middle itself: the client's stream and
        how a piece of the body is framed; None for an answer without a body (to HEAD)."""
        if self._framing is NONE:
            return None
        return self._stream, (chunk if self._framing is CHUNKED else _as_is)

    def abandon(self) -> None:
        """A bug of ours interrupted the handler: whatever went out, the answer does not
        count as whole, and the connection ends with it."""
        self.complete = False

    def mark_first_byte(self) -> None:
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()

    def _frame(self, data: bytes) -> bytes:
        if self._framing is CHUNKED:
            return chunk(data)
        return data if self._framing is not NONE else b""

    def _ending(self) -> bytes:
        return LAST_CHUNK if self._framing is CHUNKED else b""

    async def write(self, data: bytes) -> None:
        """More of the body; `data` must not be empty."""
        self.mark_first_byte()
        await self._send(self._frame(data))

    async def end(self, last: bytes = b"") -> None:
        """The rest of the body, if any, and its end, in one write."""
        payload = self._frame(last) if last else b""
        if last:
            self.mark_first_byte()
        payload += self._ending()
        if payload:
            await self._send(payload)
        self.complete = True

    async def _send(self, payload: bytes) -> None:
        try:
            await self._stream.send(payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ClientGone from None


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


def _as_is(data: bytes) -> bytes:
    return data


def _too_large(limit: int) -> ClientError:
    # The rest of the body stays unread, so the connection must close; saying so keeps a
    # keep-alive client from sending its next request into it.
    return ClientError(
        f"The request body is larger than {limit} bytes.",
        code="request_too_large",
        status=413,
        headers=[CLOSE],
    )
