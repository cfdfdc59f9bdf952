"""The gRPC server of the endpoint-picker door: HTTP/2 (h2c) on Trio streams, a task per
connection and a task per call, all on Sluice's one Trio loop.

Why not grpcio: Envoy's ext_proc exchanges 11 messages per proxied request, and grpcio's
server hands each one to a Trio handler across threads (`trio.from_thread.run`), its C-core
threads contending for the GIL with the loop. Through a real Envoy (`python -m
load.grpc_stack`) this server spent ~540 µs of CPU per request, grpcio ~2,400-2,650 (its
loop thread alone as much as all of ours). The protocol (h2's state plus what makes it
gRPC) is grpc_connection.py's, without I/O; this module only reads, writes and waits.

Handlers see a `MessageStream` per call: raw protobuf bytes in and out, and the request's
headers. `receive` and `send` return without a checkpoint when they need not wait (a
message is there; the answer fits the peer's windows and our write buffer), so a handler
answering a burst of messages gets all its answers into one write. `send` waits while the
peer's windows are shut or OUTBOUND_HIGH_WATER bytes wait for a peer that reads slowly: a
slow peer stops its handler, nothing grows. Returning ends the call with OK, raising
GrpcError with its status, any other exception with INTERNAL (logged); a peer's reset
cancels the handler. Nothing a peer sends reaches past its own connection.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import NoReturn, Protocol

import trio

from app.epp.grpc_connection import GrpcConnection
from app.epp.grpc_events import CallClosed, CallReadable, CallStarted, Wait, WindowOpened
from app.epp.grpc_wire import (
    DEFAULT_LIMITS,
    GrpcError,
    Headers,
    Limits,
    StatusCode,
    frame_message,
)
from app.epp.wakeup import Wakeup
from app.http.graceful import Listening

log = logging.getLogger("sluice.epp.grpc")

READ_BYTES = 64 * 1024
# Bytes queued for a peer that reads slowly before `send`, and the reader, wait for it.
OUTBOUND_HIGH_WATER = 256 * 1024
# How long a closing connection may take to hand its last frames (GOAWAY) to the socket.
CLOSE_GRACE = 1.0


class MessageStream(Protocol):
    """One call's messages, as raw protobuf bytes."""

    async def receive(self) -> bytes | None:
        """The next request message; None once the client has half-closed."""
        ...

    async def send(self, message: bytes) -> None:
        """One response message, queued within the peer's flow-control windows."""
        ...

    @property
    def metadata(self) -> Headers:
        """The request's headers as received, pseudo-headers (`:path`...) included."""
        ...

    def send_initial_metadata(self) -> None:
        """Prepare the response headers now, while waiting, rather than with the first
        message; they are written with it."""
        ...


Handler = Callable[[MessageStream], Awaitable[None]]


class _Call:
    """A call's MessageStream, and what its task needs to stop it."""

    __slots__ = ("_io", "_metadata", "_wakeup", "closed", "path", "scope", "stream_id")

    def __init__(self, io: _Connection, event: CallStarted) -> None:
        self._io = io
        self.stream_id = event.stream_id
        self.path = event.path
        self._metadata = event.metadata
        self.scope = trio.CancelScope()
        if event.timeout is not None:
            self.scope.deadline = trio.current_time() + event.timeout
        self._wakeup = Wakeup()
        self.closed = False  # over from the peer's side: send nothing more

    @property
    def metadata(self) -> Headers:
        return self._metadata

    def wake(self) -> None:
        self._wakeup.wake()

    def send_initial_metadata(self) -> None:
        self._io.connection.start_answer(self.stream_id)

    async def receive(self) -> bytes | None:
        # No checkpoint when a message is already there: a handler that answers every
        # message of a burst before it parks gets its answers written in one go.
        connection = self._io.connection
        while (message := connection.next_message(self.stream_id)) is Wait.WAIT:
            await self._wakeup.wait()
        if self.closed:
            await self._gone()
        # Reading may have freed window: its WINDOW_UPDATE goes out with the next write.
        self._io.queue_output()
        return message

    async def send(self, message: bytes) -> None:
        io, stream_id = self._io, self.stream_id
        connection = io.connection
        data = frame_message(message)
        sent = connection.send_some(stream_id, data)
        while sent < len(data):
            if not connection.is_open(stream_id):
                await self._gone()
            io.queue_output()
            await io.window_opened.park()
            sent += connection.send_some(stream_id, memoryview(data)[sent:])
        io.queue_output()
        # Queued, not yet written: we wait only while too much waits to be written.
        await io.wait_writable()

    async def _gone(self) -> NoReturn:
        self.scope.cancel()
        await trio.lowlevel.checkpoint()
        # Reached only if the handler shielded itself from the cancellation.
        raise GrpcError(StatusCode.CANCELLED, "the call is over")


def _status_of(error: BaseException) -> tuple[StatusCode, str] | None:
    """The status a handler's exception asks for, also inside a one-leaf group."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return (error.code, error.message) if isinstance(error, GrpcError) else None


class _Connection:
    """The tasks of one connection: a reader (this one), a writer, one per call.

    Only the writer writes. Calls and the reader add to `_outbound` and wake it; it yields
    once before it writes, so that every call woken by the same bytes has queued its answer
    by then: one send() for all of them. (A send() on loopback costs tens of µs, several
    times h2's work for one frame.) And a call cancelled mid-way can never cut a write in
    two, which would tear a frame and with it every call of the connection.
    """

    def __init__(
        self, stream: trio.abc.Stream, handlers: Mapping[str, Handler], limits: Limits
    ) -> None:
        self.stream = stream
        self.handlers = handlers
        self.connection = GrpcConnection(handlers, limits)
        self.calls: dict[int, _Call] = {}
        self.window_opened = trio.lowlevel.ParkingLot()
        self._outbound = bytearray()
        self._writing = 0  # bytes handed to the stream, not yet accepted by it
        self._write_wanted = Wakeup()
        self._written = trio.lowlevel.ParkingLot()
        self._writer_gone = False
        self._reading = trio.CancelScope()
        self.draining = False

    def drain(self) -> None:
        """GOAWAY: the calls begun are served to their end; then the connection closes."""
        self.draining = True
        self.connection.go_away()
        self.queue_output()
        self._close_if_drained()

    def _close_if_drained(self) -> None:
        if self.draining and not self.calls:
            self._reading.cancel()

    def queue_output(self) -> None:
        """Take what h2 queued into our buffer, and have the writer write it."""
        data = self.connection.data_to_send()
        if data:
            self._outbound += data
            self._write_wanted.wake()

    async def wait_writable(self, high_water: int = OUTBOUND_HIGH_WATER) -> None:
        """Returns at once unless more than `high_water` bytes wait for a slow peer."""
        while len(self._outbound) + self._writing > high_water and not self._writer_gone:
            await self._written.park()

    async def _write(self) -> None:
        try:
            while True:
                while not self._outbound:
                    await self._write_wanted.wait()
                await trio.lowlevel.cancel_shielded_checkpoint()
                self.queue_output()
                data, self._outbound = self._outbound, bytearray()
                self._writing = len(data)
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    # The peer is gone: every task of this connection stops.
                    self.nursery.cancel_scope.cancel()
                    return
                self._writing = 0
                self._written.unpark_all()
        finally:
            self._writer_gone = True
            self._written.unpark_all()

    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self._write)
            with self._reading:
                await self._read()
            # A GOAWAY we owe the peer goes out if it can within CLOSE_GRACE.
            self.queue_output()
            with trio.move_on_after(CLOSE_GRACE):
                await self.wait_writable(high_water=0)
            nursery.cancel_scope.cancel()

    async def _read(self) -> None:
        self.queue_output()  # our SETTINGS: the server's connection preface
        while not self.connection.ended:
            try:
                data = await self.stream.receive_some(READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            for event in self.connection.receive_data(bytes(data)):
                if isinstance(event, CallReadable):
                    if (call := self.calls.get(event.stream_id)) is not None:
                        call.wake()
                elif isinstance(event, CallStarted):
                    call = self.calls[event.stream_id] = _Call(self, event)
                    self.nursery.start_soon(self._run, call, self.handlers[event.path])
                elif isinstance(event, CallClosed):
                    if (call := self.calls.pop(event.stream_id, None)) is not None:
                        call.closed = True
                        call.scope.cancel()
                        call.wake()
                        self._close_if_drained()
                elif isinstance(event, WindowOpened):
                    self.window_opened.unpark_all()
                # ConnectionEnded: `connection.ended` ends this loop.
            self.queue_output()
            # A peer that sends without reading what we answer stops being read.
            await self.wait_writable()

    async def _run(self, call: _Call, handler: Handler) -> None:
        code, message = StatusCode.OK, ""
        with call.scope:
            try:
                await handler(call)
            except Exception as error:
                status = _status_of(error)
                if status is None:
                    log.exception("gRPC handler of %s failed", call.path)
                    status = StatusCode.INTERNAL, "internal error"
                code, message = status
        if call.closed:
            return
        if call.scope.cancelled_caught:
            # Nothing else cancels this scope: the call's grpc-timeout has passed.
            code, message = StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
        self.calls.pop(call.stream_id, None)
        self.connection.end_call(call.stream_id, code, message)
        self.queue_output()
        self._close_if_drained()


async def serve_connection(
    stream: trio.abc.Stream, handlers: Mapping[str, Handler], limits: Limits = DEFAULT_LIMITS
) -> None:
    """Serve one HTTP/2 connection until the peer leaves, breaks the protocol or says
    GOAWAY; then close `stream`. Calls still running are cancelled."""
    await GrpcServer(handlers, limits).serve_stream(stream)


class GrpcServer:
    """The connections of one listener, and their graceful end: `close` stops accepting
    and sends every connection GOAWAY (its calls run on), `wait_idle` waits for the last."""

    def __init__(self, handlers: Mapping[str, Handler], limits: Limits = DEFAULT_LIMITS) -> None:
        self.handlers = handlers
        self.limits = limits
        self._listening = Listening(_Connection.drain)
        self._idle = trio.lowlevel.ParkingLot()

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on `host`:`port` (0: a free port), report the port bound, serve each
        connection in its own task until cancelled, or until closed and idle."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        if port == 0:
            # Each address would get a port of its own: keep the first, so there is one port.
            for extra in listeners[1:]:
                await extra.aclose()
            listeners = listeners[:1]
        bound: int = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(bound)
            with self._listening.accepting:
                await trio.serve_listeners(self.serve_stream, listeners, handler_nursery=nursery)

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        connection = _Connection(stream, self.handlers, self.limits)
        self._listening.add(connection)
        try:
            await connection.serve()
        except Exception:
            # A bug of ours, not the peer's: it costs this connection only.
            log.exception("gRPC connection failed")
        finally:
            self._listening.discard(connection)
            if not self._listening.connections:
                self._idle.unpark_all()
            await trio.aclose_forcefully(stream)

    @property
    def closing(self) -> bool:
        return self._listening.closing

    def close(self) -> None:
        self._listening.close()

    async def wait_idle(self) -> None:
        while self._listening.connections:
            await self._idle.park()


async def serve_grpc(
    handlers: Mapping[str, Handler],
    host: str,
    port: int,
    *,
    limits: Limits = DEFAULT_LIMITS,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`GrpcServer(handlers, limits).serve(host, port)`, for a server never closed."""
    await GrpcServer(handlers, limits).serve(host, port, task_status=task_status)
