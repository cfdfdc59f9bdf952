"""The load generator's one HTTP client: HTTP/1.1 keep-alive on bare Trio sockets. Every
scenario, the soak, `compare`, `profile` and `run` send through it (load/drive.py measures a
request with it; the control calls, /metrics, /health, /sim/..., use `call`).

Cheap on purpose. On a 2-core machine the load generator shares the CPU with what it
measures; httpx spends about as much CPU per request as the proxy under test, so a closed
loop driven by it measures the client. This one sends pre-built request bytes and reads
`content-length`, chunked or read-until-close answers, nothing else, and does the same work
for every target.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import trio

from load.workloads import Request

CHAT = "/v1/chat/completions"
# The overhead scenario's request: one non-streaming one-token chat.
ONE_TOKEN = {
    "model": "sim",
    "messages": [{"role": "user", "content": "Say one word."}],
    "max_tokens": 1,
}
ONE_TOKEN_REQUEST = Request(CHAT, ONE_TOKEN, "one-token")


class ConnectFailed(ConnectionError):
    """The TCP connection could not be opened."""


NO_TIMEOUT = contextlib.nullcontext()  # reusable: it holds no state
# What a failed exchange raises (a malformed answer is a ValueError or an IndexError).
ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ValueError, IndexError)
# ... and with a timeout: what a caller that gives up on a server catches.
FAILURES = (*ERRORS, trio.TooSlowError)


def encode(
    netloc: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    """The bytes of one request; a body is sent as JSON unless `headers` say otherwise."""
    lines = [f"{method} {path} HTTP/1.1", f"host: {netloc}"]
    extra = {k.lower(): v for k, v in (headers or {}).items()}
    if body or method == "POST":
        extra.setdefault("content-type", "application/json")
        lines.append(f"content-length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Connection:
    """One keep-alive connection: `start` sends a request and reads its head, `read_chunk`
    the body piece by piece (None at its end)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.stream: trio.SocketStream | None = None
        self.buffer = b""
        self.status = 0
        self.headers: dict[str, str] = {}
        self._mode = ""  # the body being read: "chunked", "length", "close" or "" (none)
        self._left = 0
        self._close = False

    async def _receive(self) -> bytes:
        assert self.stream is not None
        data = await self.stream.receive_some(65536)
        if not data:
            raise ConnectionError("connection closed")
        return data

    async def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            self.buffer += await self._receive()
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    async def _read_exact(self, size: int) -> bytes:
        if len(self.buffer) < size:
            parts, have = [self.buffer], len(self.buffer)
            while have < size:
                parts.append(await self._receive())
                have += len(parts[-1])
            self.buffer = b"".join(parts)
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    async def start(self, request: bytes) -> None:
        """Send `request` and read the response's head (`status`, `headers`)."""
        if self.stream is None:
            try:
                self.stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:
                raise ConnectFailed(str(exc)) from exc
            self.buffer = b""
        try:
            # A server may answer (413) and close before reading it all: read that answer.
            with contextlib.suppress(trio.BrokenResourceError):
                await self.stream.send_all(request)
            head = (await self._read_until(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            self.status = int(head[0].split()[1])
            self.headers = {
                k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])
            }
        except BaseException:
            await self.close()
            raise
        self._close = self.headers.get("connection", "").lower() == "close"
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            self._mode = "chunked"
        elif "content-length" in self.headers:
            self._left = int(self.headers["content-length"])
            self._mode = "length" if self._left else ""
        elif self.status in (204, 304) or self.status < 200:
            self._mode = ""
        else:
            self._mode, self._close = "close", True

    async def read_chunk(self) -> bytes | None:
        """The next piece of the body as it comes; None once it has all been read."""
        try:
            if self._mode == "chunked":
                size = int((await self._read_until(b"\r\n")).split(b";")[0], 16)
                if size:
                    return (await self._read_exact(size + 2))[:-2]
                while await self._read_until(b"\r\n"):  # trailers, up to the empty line
                    pass
            elif self._mode == "length":
                data, self._left = await self._read_exact(self._left), 0
                self._mode = ""
                return data
            elif self._mode == "close":
                if self.buffer:
                    data, self.buffer = self.buffer, b""
                    return data
                assert self.stream is not None
                data = await self.stream.receive_some(65536)
                if data:
                    return data
        except BaseException:
            await self.close()
            raise
        self._mode = ""
        return None

    async def receive_raw(self) -> bytes:
        """What is buffered, else the next read from the socket, framing and all: for a
        caller that counts events per read and finds the body's end itself."""
        if self.buffer:
            data, self.buffer = self.buffer, b""
            return data
        return await self._receive()

    async def read_body(self) -> bytes:
        if self._mode == "length" and len(self.buffer) >= self._left:  # the common case
            data, self.buffer = self.buffer[: self._left], self.buffer[self._left :]
            self._mode, self._left = "", 0
            return data
        parts = []
        while (chunk := await self.read_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    @property
    def reusable(self) -> bool:
        """The last answer was read to its end and the server keeps the connection."""
        return self.stream is not None and not self._mode and not self._close

    async def close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            self.buffer, self._mode = b"", ""
            await trio.aclose_forcefully(stream)


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def raise_for_status(self) -> Reply:
        if self.status >= 400:
            raise RuntimeError(f"answered {self.status}: {self.text[:200]}")
        return self


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request as bytes on the wire, built once for a pool."""

    tag: str
    streaming: bool
    data: bytes


class Pool:
    """Idle keep-alive connections to one target, reused as a client library would; at most
    `limit` requests at once (the others wait), each given up after `timeout` s (None: never,
    and no cancel scope per request)."""

    def __init__(
        self,
        url: str,
        headers: dict[str, str] | None = None,
        *,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self.url = url
        self.netloc = urlsplit(url).netloc
        self.headers = headers or {}
        self.timeout = timeout
        self.idle: list[Connection] = []
        self.limit = trio.Semaphore(limit) if limit else None

    def prepare(self, request: Request, stream: bool = False) -> Prepared:
        """`request` as bytes; `stream` makes it a streaming one (`"stream": true`)."""
        body = {**request.body, "stream": True} if stream else request.body
        data = encode(self.netloc, "POST", request.path, json.dumps(body).encode(), self.headers)
        return Prepared(request.tag, bool(body.get("stream")), data)

    async def start(self, request: bytes) -> Connection:
        """A connection that sent `request` and read the answer's head; hand it back with
        `finish` (a pooled connection the server closed meanwhile is retried once)."""
        if self.limit is not None:
            await self.limit.acquire()
        try:
            reused = bool(self.idle)
            connection = self.idle.pop() if reused else Connection(self.url)
            try:
                await connection.start(request)
            except ERRORS:
                if not reused:
                    raise
                connection = Connection(self.url)
                await connection.start(request)
        except BaseException:
            if self.limit is not None:
                self.limit.release()
            raise
        return connection

    def keep(self, connection: Connection) -> bool:
        """Keep `connection` for the next request if its answer was read whole (True); when
        False, the caller closes it (`finish` does both)."""
        if self.limit is not None:
            self.limit.release()
        if connection.reusable:
            self.idle.append(connection)
            return True
        return False

    async def finish(self, connection: Connection) -> None:
        if not self.keep(connection):
            await connection.close()

    async def send(self, request: bytes) -> Reply:
        """One request (bytes on the wire), its answer read whole."""
        with trio.fail_after(self.timeout) if self.timeout else NO_TIMEOUT:
            connection = await self.start(request)
            try:
                return Reply(connection.status, connection.headers, await connection.read_body())
            finally:
                await self.finish(connection)

    async def call(
        self, method: str, path: str, *, json_body: Any = None, content: bytes = b""
    ) -> Reply:
        if json_body is not None:
            content = json.dumps(json_body).encode()
        return await self.send(encode(self.netloc, method, path, content, self.headers))

    async def warm(self, requests: int = 50) -> None:
        """Open a connection and pay first-request costs before anything is measured."""
        prepared = self.prepare(ONE_TOKEN_REQUEST)
        for _ in range(requests):
            await self.send(prepared.data)

    async def close(self) -> None:
        idle, self.idle = self.idle, []
        for connection in idle:
            await connection.close()

    async def __aenter__(self) -> Pool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def call(
    url: str,
    method: str = "GET",
    *,
    json_body: Any = None,
    content: bytes = b"",
    headers: dict[str, str] | None = None,
    give_up_s: float = 30.0,
) -> Reply:
    """One request on a connection of its own (for /metrics, /health, /sim/... and the like):
    raises one of FAILURES when the server cannot be reached or takes over `give_up_s`."""
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if json_body is not None:
        content = json.dumps(json_body).encode()
    connection = Connection(url)
    try:
        with trio.fail_after(give_up_s):
            await connection.start(encode(parts.netloc, method, path, content, headers))
            return Reply(connection.status, connection.headers, await connection.read_body())
    finally:
        await connection.close()


@contextlib.asynccontextmanager
async def streaming(
    url: str,
    method: str = "GET",
    *,
    json_body: Any = None,
    headers: dict[str, str] | None = None,
) -> AsyncIterator[Connection]:
    """A request on a connection of its own, its answer's head read: the body reads the
    rest as it comes (`read_chunk`, `Lines`); the connection is closed at the end."""
    parts = urlsplit(url)
    content = b"" if json_body is None else json.dumps(json_body).encode()
    connection = Connection(url)
    try:
        await connection.start(encode(parts.netloc, method, parts.path or "/", content, headers))
        yield connection
    finally:
        await connection.close()


class Lines:
    """A body's lines as they come, without their line ends: `async for line in Lines(c)`."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.pending = b""

    def __aiter__(self) -> Lines:
        return self

    async def __anext__(self) -> bytes:
        while b"\n" not in self.pending:
            chunk = await self.connection.read_chunk()
            if chunk is None:
                if not self.pending:
                    raise StopAsyncIteration
                line, self.pending = self.pending, b""
                return line
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.rstrip(b"\r")
