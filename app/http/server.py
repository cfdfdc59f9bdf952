"""The proxy port's HTTP/1.1 server: one task per connection on Trio streams.

Why not hypercorn, which still serves the dashboard: measured here (`python -m load bench
overhead`, its floors), hypercorn's Trio worker costs 1.1-1.4 ms of CPU to answer a request
with no work behind it, h11 on bare Trio streams 0.4-0.6 ms; and every relayed chunk went
through an ASGI message and hypercorn's send path, ~28% of the relay's CPU. Heads are read
by request_head.py (h11 read them until its per-request ~45 µs showed in the profiles),
bodies by body_framing.py.

What clients get: keep-alive; pipelined requests answered in order, one at a time (what
arrives meanwhile waits in the kernel); a client that leaves mid-answer cancels its request
(departures.py); chunked request bodies; `Expect: 100-continue`; 431 for a head over
`max_head_bytes`, 400 for one that is not HTTP/1.1 (request_head.py has the list), 505 for
another version, 501 for a transfer coding other than chunked, 408 for a head not whole
within `read_timeout` of its first byte; idle keep-alive connections closed after
`keep_alive_timeout`; HTTP/1.0 clients, answered until close. A slow or silent client costs
its socket and two parked tasks, never the loop. A handler's bug costs its own request (500)
and its connection, nothing else.

Shutdown (`close`): stop accepting, close connections waiting for a request, let answers in
flight finish, each the last on its connection; `wait_idle` tells when they have, and the
caller cancels whatever is left when its grace period ends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import trio

from app.http.departures import Departures
from app.http.errors import ClientError
from app.http.exchange import ClientConnection, ClientGone, Exchange
from app.http.listeners import reuse_port_listeners
from app.http.request_head import RequestHead
from app.http.streams import ByteStream, byte_stream
from app.proxy.errors import respond_internal_error

log = logging.getLogger("sluice.proxy")

KEEP_ALIVE_TIMEOUT_S = 75.0
READ_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 16384  # h11's default, and hypercorn's

Handler = Callable[[Exchange], Awaitable[None]]


class HttpServer:
    def __init__(
        self,
        handler: Handler,
        *,
        keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT_S,
        read_timeout: float = READ_TIMEOUT_S,
        max_head_bytes: int = MAX_HEAD_BYTES,
        reuse_port: bool = False,
    ) -> None:
        """`reuse_port`: join the port's SO_REUSEPORT group, shared by the processes of
        `--workers N` (shared_port.py)."""
        self._handler = handler
        self._reuse_port = reuse_port
        self._keep_alive_timeout = keep_alive_timeout
        self._read_timeout = read_timeout
        self._max_head_bytes = max_head_bytes
        self.closing = False
        self._listening = trio.CancelScope()
        self._connections: set[ClientConnection] = set()
        self.answering = 0  # requests being answered now
        self._idle = trio.Event()
        # Clients that leave mid-answer: `serve` runs it (tests of `serve_connection` alone
        # may start `departures.run` themselves).
        self.departures = Departures()

    async def serve(
        self,
        host: str,
        port: int,
        backlog: int,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen, report the URL, serve until `close` and every connection has ended."""
        if self._reuse_port:
            listeners = reuse_port_listeners(host, port, backlog)
        else:
            listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
        bound_port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as watching:
            await watching.start(self.departures.run)
            async with trio.open_nursery() as connections:
                connections.start_soon(self._accept, listeners, connections)
                task_status.started(f"http://{host}:{bound_port}")
            watching.cancel_scope.cancel()

    async def _accept(
        self, listeners: list[trio.SocketListener], connections: trio.Nursery
    ) -> None:
        with self._listening:
            await trio.serve_listeners(self._serve_socket, listeners, handler_nursery=connections)

    async def _serve_socket(self, stream: trio.SocketStream) -> None:
        await self.serve_connection(byte_stream(stream))

    def close(self) -> None:
        """Stop accepting and close idle connections; answers in flight go on."""
        self.closing = True
        self._listening.cancel()
        for connection in self._connections:
            if not connection.answering and connection.ended is not None:
                connection.ended.cancel()

    def _is_closing(self) -> bool:
        return self.closing

    async def wait_idle(self) -> None:
        """Return once no request is being answered (idle keep-alives don't count)."""
        while self.answering:
            self._idle = trio.Event()
            await self._idle.wait()

    async def serve_connection(self, stream: ByteStream) -> None:
        """Answer the requests of one connection until it ends, then close it.

        One task reads each request and answers it; a client that leaves meanwhile is
        noticed by `departures`. A second task ends the connection when it has been idle
        too long (`_expire_when_idle`)."""
        now = trio.current_time()
        connection = ClientConnection(stream, self._max_head_bytes, now, self.departures)
        self._connections.add(connection)
        try:
            async with trio.open_nursery() as nursery:
                connection.start_watching(nursery.cancel_scope)
                nursery.start_soon(self._expire_when_idle, connection)
                while True:
                    request = await self._read_request(connection)
                    if request is None or not await self._answer_requests(connection, request):
                        break
                nursery.cancel_scope.cancel()
        finally:
            self._connections.discard(connection)
            connection.stop_watching()
            await stream.aclose()

    async def _read_request(self, connection: ClientConnection) -> RequestHead | None:
        """Read until a request's head is whole, or None when the connection should end."""
        while True:
            try:
                request = connection.next_request()
            except ClientError as error:
                await connection.refuse(error)
                return None
            if request is not None:
                return request
            if connection.peer_gone or self.closing:
                return None
            if connection.unread and connection.head_started is None:
                connection.head_started = trio.current_time()
                self._hurry_timer(connection)
            await connection.read_some()

    def _hurry_timer(self, connection: ClientConnection) -> None:
        """A head began and is not whole yet: it has the read timeout from its first byte,
        sooner than the keep-alive timeout the connection's timer may be waiting for."""
        if connection.timer is not None:
            connection.timer.deadline = min(connection.timer.deadline, self._expiry(connection))

    def _expiry(self, connection: ClientConnection) -> float:
        """When the connection ends if nothing is answered meanwhile: the read timeout after
        the first byte of an unfinished head, else the keep-alive timeout after it went
        idle."""
        if connection.head_started is not None:
            return connection.head_started + self._read_timeout
        return connection.idle_since + self._keep_alive_timeout

    async def _expire_when_idle(self, connection: ClientConnection) -> None:
        """The connection's timer: end it, with a 408 when a head was left unfinished, once
        it has been idle past its expiry.

        A task per connection rather than a deadline on every read: requests move the
        expiry with a plain assignment (`idle_since`), and the timer wakes about once per
        timeout period to look, where a cancel scope per read cost every request ~10 µs of
        Trio's deadline bookkeeping."""
        while True:
            if connection.answering:
                # The earliest an answer that has not ended yet can make it expire.
                expiry = trio.current_time() + min(self._keep_alive_timeout, self._read_timeout)
            else:
                expiry = self._expiry(connection)
            with trio.CancelScope(deadline=expiry) as sleeping:
                connection.timer = sleeping
                await trio.sleep_forever()
            connection.timer = None
            if connection.answering or trio.current_time() < self._expiry(connection):
                continue
            if connection.unread:
                late = f"The request head did not arrive within {self._read_timeout:g}s."
                with trio.move_on_after(self._read_timeout):
                    await connection.refuse(ClientError(late, code="request_timeout", status=408))
            if connection.ended is not None:
                connection.ended.cancel()
            return

    async def _answer_requests(self, connection: ClientConnection, request: RequestHead) -> bool:
        """Answer `request` and any whole request read behind it; whether the connection
        goes on."""
        while True:
            exchange = Exchange(
                connection, request, read_timeout=self._read_timeout, closing=self._is_closing
            )
            if not await self._answer(connection, exchange) or not exchange.keep_alive:
                return False
            if self.closing:
                return False
            connection.next_cycle()
            try:
                following = connection.next_request()
            except ClientError as error:
                await connection.refuse(error)
                return False
            if following is None:
                connection.end_answering(trio.current_time())
                if connection.head_started is not None:
                    self._hurry_timer(connection)
                return not connection.peer_gone
            request = following

    async def _answer(self, connection: ClientConnection, exchange: Exchange) -> bool:
        """Run the handler; whether the connection may carry another request. A client
        that leaves meanwhile cancels the connection's scope, this answer with it."""
        self.answering += 1
        connection.begin_answering()
        try:
            await self._handler(exchange)
        except ClientGone:
            return False
        except Exception:
            # A bug of ours must cost this request only, and still answer in OpenAI's shape.
            log.exception("unexpected error while serving %s %s", exchange.method, exchange.path)
            if not exchange.started:
                with contextlib.suppress(ClientGone):
                    await respond_internal_error(exchange)
            return False
        finally:
            self.answering -= 1
            if not self.answering:
                self._idle.set()
        return exchange.complete
