"""One connection's bytes, moved with as few passes through Trio's scheduler as traffic allows.

Trio makes every `receive_some` and `send_all` a checkpoint: a pass through the scheduler
even when the socket had the data or the room at once. A relayed token crosses a socket
twice, so that was most of its cost (measured here: `send_all` + `receive_some` 11.7 µs a
pair, the same system calls without the checkpoints 2.1 µs). `SocketBytes` calls the
kernel first and waits (`wait_readable` / `wait_writable`) only when the call would block;
a connection that keeps completing at once still yields every `YIELD_EVERY` operations, so
a fast peer never keeps the loop to itself, and a cancelled task still stops at its next
wait or yield.

`StreamBytes` wraps any other `trio.abc.Stream` with the same methods: tests drive the
server and the upstream pool over `trio.testing.memory_stream_pair`, no port and no clock.

Errors: a reset or broken connection is `trio.BrokenResourceError`, a stream used after
`aclose` is `trio.ClosedResourceError`, and `receive` returns b"" at end of input.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
from collections.abc import Iterator

import trio

RECEIVE_SIZE = 65536
YIELD_EVERY = 16


class ByteStream:
    """The interface both kinds of connection share."""

    async def receive(self, max_bytes: int = RECEIVE_SIZE) -> bytes:
        raise NotImplementedError

    async def send(self, data: bytes) -> None:
        raise NotImplementedError

    def closed_by_peer(self) -> bool:
        """Whether an idle connection was closed (or spoken to) by the other end; False when
        that cannot be asked without reading."""
        return False

    def fileno(self) -> int | None:
        """The socket's descriptor while open, for code that waits on many at once (the
        relay hub, the departure watcher); None for a stream that is not a socket."""
        return None

    def abort(self) -> None:
        """Close at once, from another task: a `receive` or `send` waiting on this stream
        raises trio.ClosedResourceError."""
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


def byte_stream(stream: trio.abc.Stream) -> ByteStream:
    return SocketBytes(stream) if isinstance(stream, trio.SocketStream) else StreamBytes(stream)


class SocketBytes(ByteStream):
    __slots__ = ("_closed", "_drained", "_socket", "_stream", "_unyielded")

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._socket = stream.socket
        self._unyielded = 0
        self._drained = False  # the last read returned less than it asked for
        self._closed = False

    def _fd(self) -> int:
        # Asked every time, never kept: a closed socket's number may already be another's.
        if self._closed:
            raise trio.ClosedResourceError("the connection is closed")
        return self._socket.fileno()

    async def receive(self, max_bytes: int = RECEIVE_SIZE) -> bytes:
        if self._drained:
            # The last read took all there was: a read now would almost always fail
            # (EAGAIN, a system call and a Python exception per token); wait first.
            await trio.lowlevel.wait_readable(self._fd())
            self._unyielded = 0
        while True:
            fd = self._fd()
            try:
                data = os.read(fd, max_bytes)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)
                self._unyielded = 0
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"connection lost: {exc}") from None
            self._drained = len(data) < max_bytes
            if not self._drained:
                self._unyielded += 1
                if self._unyielded >= YIELD_EVERY:
                    self._unyielded = 0
                    await trio.lowlevel.checkpoint()
            return data

    async def send(self, data: bytes) -> None:
        view: memoryview | None = None
        while True:
            fd = self._fd()
            try:
                sent = os.write(fd, data if view is None else view)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise trio.BrokenResourceError(f"connection lost: {exc}") from None
            if view is None:
                if sent == len(data):
                    self._unyielded += 1
                    if self._unyielded >= YIELD_EVERY:
                        self._unyielded = 0
                        await trio.lowlevel.checkpoint()
                    return
                view = memoryview(data)
            view = view[sent:]
            if not view:
                return
            # The peer reads slower than we write: wait for room (back-pressure).
            await trio.lowlevel.wait_writable(fd)
            self._unyielded = 0

    def receive_now(self, max_bytes: int = RECEIVE_SIZE) -> bytes | None:
        """What has arrived, without waiting: None when nothing has (b"" at end of input).
        For the relay hub, which waits on the descriptor itself."""
        try:
            return os.read(self._fd(), max_bytes)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise trio.BrokenResourceError(f"connection lost: {exc}") from None

    def send_now(self, data: bytes | memoryview) -> int:
        """Send what the socket takes at once, without waiting; how many bytes it took."""
        try:
            return os.write(self._fd(), data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise trio.BrokenResourceError(f"connection lost: {exc}") from None

    def fileno(self) -> int | None:
        return None if self._closed else self._socket.fileno()

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._socket.close()  # Trio's close wakes the fd's waiters first

    def closed_by_peer(self) -> bool:
        if self._closed:
            return True
        # poll, not select: select refuses descriptors from 1024 on, which a proxy holding
        # 1,000 client connections reaches.
        poller = select.poll()
        poller.register(self._socket.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            try:
                await self._stream.aclose()
            except OSError as exc:  # closing a reset socket may report the reset
                if exc.errno not in (errno.ECONNRESET, errno.ENOTCONN):
                    raise


class StreamBytes(ByteStream):
    """Any Trio stream. A generic stream cannot be closed without waiting, so each operation
    runs in a cancel scope that `abort` cancels: a cost only the tests' streams pay."""

    __slots__ = ("_aborted", "_operations", "_stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._operations: set[trio.CancelScope] = set()
        self._aborted = False

    async def receive(self, max_bytes: int = RECEIVE_SIZE) -> bytes:
        with self._abortable():
            return bytes(await self._stream.receive_some(max_bytes))
        raise trio.ClosedResourceError("the connection was aborted")

    async def send(self, data: bytes) -> None:
        with self._abortable():
            await self._stream.send_all(data)
            return
        raise trio.ClosedResourceError("the connection was aborted")

    @contextlib.contextmanager
    def _abortable(self) -> Iterator[None]:
        if self._aborted:
            raise trio.ClosedResourceError("the connection was aborted")
        with trio.CancelScope() as scope:
            self._operations.add(scope)
            try:
                yield
            finally:
                self._operations.discard(scope)

    def abort(self) -> None:
        self._aborted = True
        for scope in self._operations:
            scope.cancel()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._stream.aclose()
