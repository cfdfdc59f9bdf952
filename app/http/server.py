"""The HTTP/1.1 server of the proxy's port and of the simulated backend: a task per connection
on Trio streams.

Why not hypercorn, which still serves the dashboard: measured here (`python -m load bench
overhead`, its floors), hypercorn's Trio worker costs 1.1-1.4 ms of CPU to answer a request
with no work behind it, h11 on bare Trio streams 0.4-0.6 ms; and every relayed chunk went
through an ASGI message and hypercorn's send path, ~28% of the relay's CPU. Heads are read
by request_head.py, bodies by framing.py, and each connection's state is connection.py's,
which does no I/O: this module reads and writes, runs each connection's timer and acts on
what the connection decides (exchange.py does the same for a request's body and answer).

What clients get: keep-alive (HTTP/1.1, and HTTP/1.0 with `Connection: keep-alive`);
pipelined requests answered in order, one at a time (what arrives meanwhile waits in the
kernel); origin-form and absolute-form targets; a client that leaves mid-answer cancels its
request (departures.py); chunked request bodies; `Expect: 100-continue`; 431 for a head over
`max_head_bytes`, 400 for one that is not HTTP/1.1 (request_head.py has the list), 505 for
another version, 501 for a transfer coding other than chunked, 408 for a head not whole
within `read_timeout` of its first byte; idle keep-alive connections closed after
`keep_alive_timeout`. A slow or silent client costs its socket and two parked tasks, never
the loop. A handler's bug costs its own request (500) and its connection, nothing else.

Shutdown (`close`): stop accepting, close connections waiting for a request, let answers in
flight finish, each the last on its connection; `wait_idle` tells when they have, and the
caller cancels whatever is left when its grace period ends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import trio

from app.errors import ClientError
from app.http.connection import DEFAULT_LIMITS, ClientConnection, Limits, Reading
from app.http.departures import Departures
from app.http.exchange import ClientGone, Exchange, read_into
from app.http.graceful import Listening
from app.http.listeners import reuse_port_listeners
from app.http.streams import ByteStream, byte_stream

log = logging.getLogger("sluice.http")

Handler = Callable[[Exchange], Awaitable[None]]


class HttpServer:
    def __init__(
        self,
        handler: Handler,
        *,
        keep_alive_timeout: float = DEFAULT_LIMITS.keep_alive_timeout,
        read_timeout: float = DEFAULT_LIMITS.read_timeout,
        max_head_bytes: int = DEFAULT_LIMITS.max_head_bytes,
        reuse_port: bool = False,
    ) -> None:
        """`reuse_port`: join the port's SO_REUSEPORT group, shared by the processes of
        `--workers N` (listeners.py)."""
        self._handler = handler
        self._reuse_port = reuse_port
        self._limits = Limits(keep_alive_timeout, read_timeout, max_head_bytes)
        self._listening = Listening(_Served.shutdown)
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
        with self._listening.accepting:
            await trio.serve_listeners(self._serve_socket, listeners, handler_nursery=connections)

    async def _serve_socket(self, stream: trio.SocketStream) -> None:
        await self.serve_connection(byte_stream(stream))

    def close(self) -> None:
        """Stop accepting and close idle connections; answers in flight go on, each the last
        on its connection."""
        self._listening.close()

    async def wait_idle(self) -> None:
        """Return once no request is being answered (idle keep-alives don't count)."""
        while self.answering:
            self._idle = trio.Event()
            await self._idle.wait()

    async def serve_connection(self, stream: ByteStream) -> None:
        """Answer the requests of one connection until it closes, then close its stream."""
        connection = ClientConnection(self._limits, trio.current_time())
        served = _Served(connection, stream)
        self._listening.add(served)
        watched = self.departures.watch(stream, served.peer_left)
        try:
            async with trio.open_nursery() as nursery:
                served.scope = nursery.cancel_scope
                if not connection.closed:
                    nursery.start_soon(self._run_timer, served)
                while not connection.closed:
                    exchange = await self._read_request(served)
                    if exchange is not None:
                        await self._answer(served, exchange)
                if served.timer is not None:
                    served.timer.cancel()
        finally:
            self._listening.discard(served)
            if watched:
                self.departures.forget(stream)
            await stream.aclose()

    async def _read_request(self, served: _Served) -> Exchange | None:
        """The next request, once its head is whole; None when the connection closed."""
        connection, stream = served.connection, served.stream
        while not connection.closed:
            now = trio.current_time()
            try:
                request = connection.next_request(now)
            except ClientError as error:
                await _send_last(stream, connection.refuse(error))
                return None
            if request is not None:
                return Exchange(connection, stream, request)
            if served.timer is not None and connection.reading is Reading.HEAD:
                # A head began: the read timeout from its first byte is sooner than the
                # keep-alive timeout the timer may be waiting for.
                served.timer.deadline = min(served.timer.deadline, connection.expiry(now))
            await read_into(connection, stream)
        return None

    async def _answer(self, served: _Served, exchange: Exchange) -> None:
        """Run the handler and tell the connection how its answer went."""
        self.answering += 1
        try:
            await self._handler(exchange)
        except ClientGone:
            pass
        except Exception as exc:
            # A bug of ours must cost this request only, and still answer in OpenAI's shape.
            log.exception("unexpected error while serving %s %s", exchange.method, exchange.path)
            if not exchange.started:
                with contextlib.suppress(ClientGone):
                    await exchange.respond_error(exc)
            exchange.abandon()
        finally:
            self.answering -= 1
            if not self.answering:
                self._idle.set()
            if exchange.at_end is not None:
                exchange.at_end(exchange)
        served.connection.answered(exchange.complete, trio.current_time())

    async def _run_timer(self, served: _Served) -> None:
        """End the connection, with a 408 when a head was left unfinished, once it has been
        idle past its expiry.

        A task per connection rather than a deadline on every read: requests move the expiry
        with a plain assignment, and the timer wakes about once per timeout period to look,
        where a cancel scope per read cost every request ~10 µs of Trio's deadline
        bookkeeping."""
        connection = served.connection
        while not connection.closed:
            with trio.CancelScope(deadline=connection.expiry(trio.current_time())) as sleeping:
                served.timer = sleeping
                await trio.sleep_forever()
            served.timer = None
            farewell = connection.time_out(trio.current_time())
            if farewell is None:
                continue
            if farewell:
                with trio.move_on_after(connection.read_timeout):
                    await _send_last(served.stream, farewell)
            served.end()


class _Served:
    """A connection being served: its state, its stream, the scope of the task serving it
    and the timer's sleep."""

    __slots__ = ("connection", "scope", "stream", "timer")

    def __init__(self, connection: ClientConnection, stream: ByteStream) -> None:
        self.connection = connection
        self.stream = stream
        self.scope: trio.CancelScope | None = None
        self.timer: trio.CancelScope | None = None

    def end(self) -> None:
        """Stop everything serving the connection once it has closed: the answer in
        progress and its backend's work, the read waiting for the next request, the timer."""
        if self.connection.closed and self.scope is not None:
            self.scope.cancel()

    def peer_left(self) -> None:
        self.connection.peer_left()
        self.end()

    def shutdown(self) -> None:
        self.connection.shutdown()
        self.end()


async def _send_last(stream: ByteStream, payload: bytes) -> None:
    """The last bytes of a connection closing: a client already gone does not get them."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send(payload)
