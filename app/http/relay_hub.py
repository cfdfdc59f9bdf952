"""The relay's steady state: one task moves every streamed answer's body, backend to client.

Why: a token relayed by its request's own task costs that task a wake-up through Trio's
scheduler, ~30 µs of CPU where the two system calls that move it take ~10 (app/README.md).

How: once an answer's head and first bytes have gone out, its request task hands the stream
to the hub and parks. The hub keeps the backend sockets of all streams in an epoll of its own
(level-triggered, registered once per stream, not once per token) and waits on that epoll's
descriptor through Trio. Each wake-up reads every ready socket, decodes and frames what
arrived and writes it to its client, in one task step; after `BATCH` streams it yields, so a
/health request never waits behind more than one batch.

Back-pressure: a client that does not take a write at once keeps what is left (at most one
read's worth), and its stream watches the client's socket instead of the backend's until the
client has taken it; the idle timeout is paused meanwhile (a slow client is not a silent
backend). Idle: a sweep every `SWEEP_S` ends streams whose backend has been silent for their
idle timeout. Streams that are not sockets (the tests' memory streams) are each moved by a
task of their own, with the same steps (`_arrived`), back-pressure and sweep.

A stream leaves the hub once, and its task wakes once: when the body ended (the read that
ended it is handed back unwritten, so the end goes out in the same write), when the backend
broke it or fell silent, or when the client's socket refused a write. A request cancelled
meanwhile (its client left, or shutdown's grace ran out) takes its stream out at once.
"""

from __future__ import annotations

import errno
import select
from collections.abc import Callable
from dataclasses import dataclass, field

import outcome
import trio

from app.errors import UpstreamError, UpstreamFault
from app.http.streams import ByteStream, SocketBytes

BATCH = 64  # streams served per task step
SWEEP_S = 1.0
READ_SIZE = 65536


@dataclass(slots=True)
class Ended:
    """How a stream left the hub."""

    last: bytes = b""  # the content of the read that ended the body: not written yet
    broken: UpstreamError | None = None  # what broke the stream on the backend's side
    client_gone: bool = False  # the client's stream refused a write


def _cut(detail: str) -> Ended:
    """A stream whose backend connection broke (or was closed) before the body ended."""
    return Ended(broken=UpstreamError(UpstreamFault.BROKEN, detail))


@dataclass(slots=True, eq=False)  # hashed by identity: a key of the hub's tables
class HubStream:
    """One answer's body in the hub: where it comes from and goes, and what a read becomes.

    `take(raw)` turns one read into content (raising `UpstreamError` on broken framing;
    raw b"" is the backend's end of input), `complete()` says whether the body has ended,
    `frame(content)` is what the client is sent for it; `first_write` is called before the
    first write."""

    upstream: ByteStream
    client: ByteStream
    take: Callable[[bytes], bytes]
    complete: Callable[[], bool]
    frame: Callable[[bytes], bytes]
    idle: float
    first_write: Callable[[], None] | None
    last_data: float = 0.0
    pending: bytes = b""  # framed bytes the client has not taken yet
    blocked: bool = False  # waiting for the client to take `pending`
    # Both ends, where both are sockets: then the hub's epoll waits for them.
    sockets: tuple[SocketBytes, SocketBytes] | None = field(init=False, default=None)
    _task: trio.lowlevel.Task | None = field(init=False, default=None)
    _pump: trio.CancelScope | None = field(init=False, default=None)  # when not on sockets

    def __post_init__(self) -> None:
        upstream, client = self.upstream, self.client
        if isinstance(upstream, SocketBytes) and isinstance(client, SocketBytes):
            self.sockets = (upstream, client)


class RelayHub:
    def __init__(self) -> None:
        self._epoll = select.epoll()
        # Backend descriptors, and client descriptors while blocked.
        self._by_fd: dict[int, HubStream] = {}
        self._fds: dict[HubStream, int] = {}  # the descriptor each socket stream waits on
        self._streams: set[HubStream] = set()
        self._first_stream = trio.Event()  # the sweep sleeps while no stream is in the hub
        self._pumps: trio.Nursery | None = None

    def __len__(self) -> int:
        return len(self._streams)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve streams until cancelled; the streams left then are ended as broken."""
        try:
            async with trio.open_nursery() as nursery:
                self._pumps = nursery
                nursery.start_soon(self._sweep_idle)
                task_status.started()
                await self._serve()
        finally:
            self._pumps = None
            for stream in list(self._streams):
                self._end(stream, _cut("the proxy is shutting down"))
            self._epoll.close()

    async def relay(self, stream: HubStream) -> Ended:
        """Relay `stream` until it ends; cancelling the caller takes it out of the hub."""
        if self._pumps is None:
            raise RuntimeError("the relay hub is not running")
        stream.last_data = trio.current_time()
        stream._task = trio.lowlevel.current_task()
        self._streams.add(stream)
        self._first_stream.set()
        if stream.sockets is None:
            self._pumps.start_soon(self._pump_task, stream)
        else:
            self._wait_on(stream, stream.sockets[0], select.EPOLLIN)

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._remove(stream)
            return trio.lowlevel.Abort.SUCCEEDED

        ended: Ended = await trio.lowlevel.wait_task_rescheduled(abort)
        return ended

    def _wait_on(self, stream: HubStream, end: SocketBytes, events: int) -> None:
        fd = end.fileno()
        if fd is None:
            self._end(stream, _cut("the connection is closed"))
            return
        self._by_fd[fd] = stream
        self._fds[stream] = fd
        self._epoll.register(fd, events)

    def _stop_waiting(self, stream: HubStream) -> None:
        fd = self._fds.pop(stream, None)
        if fd is None:
            return
        del self._by_fd[fd]
        try:
            self._epoll.unregister(fd)
        except OSError as exc:  # closed behind our back: the kernel dropped it already
            if exc.errno not in (errno.EBADF, errno.ENOENT):
                raise

    async def _serve(self) -> None:
        epoll = self._epoll
        while True:
            await trio.lowlevel.wait_readable(epoll.fileno())
            while True:
                events = epoll.poll(0, BATCH)
                now = trio.current_time()
                by_fd = self._by_fd
                for fd, _ in events:
                    stream = by_fd.get(fd)
                    if stream is None:
                        continue  # ended earlier in this batch
                    sockets = stream.sockets
                    assert sockets is not None
                    if stream.blocked:
                        self._flush(stream, sockets, now)
                    else:
                        self._read(stream, sockets, now)
                if len(events) < BATCH:
                    break
                await trio.lowlevel.checkpoint()

    def _arrived(self, stream: HubStream, raw: bytes, now: float) -> bytes:
        """One read of the backend: what to write to the client (b"" for nothing), or the
        stream's end (then it has left the hub)."""
        try:
            content = stream.take(raw)
        except UpstreamError as exc:
            self._end(stream, Ended(broken=exc))
            return b""
        stream.last_data = now
        if stream.complete():
            self._end(stream, Ended(last=content))
            return b""
        if not content:
            return b""
        if stream.first_write is not None:
            stream.first_write()
            stream.first_write = None
        return stream.frame(content)

    def _read(
        self, stream: HubStream, sockets: tuple[SocketBytes, SocketBytes], now: float
    ) -> None:
        upstream, client = sockets
        try:
            raw = upstream.receive_now(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._end(stream, _cut(str(exc)))
            return
        if raw is None:
            return
        data = self._arrived(stream, raw, now)
        if not data:
            return
        try:
            sent = client.send_now(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._end(stream, Ended(client_gone=True))
            return
        if sent < len(data):
            # The client reads slower than the backend writes: hold the rest, stop reading
            # the backend, and wait for the client instead.
            stream.pending = data[sent:]
            stream.blocked = True
            self._stop_waiting(stream)
            self._wait_on(stream, client, select.EPOLLOUT)

    def _flush(
        self, stream: HubStream, sockets: tuple[SocketBytes, SocketBytes], now: float
    ) -> None:
        upstream, client = sockets
        try:
            sent = client.send_now(stream.pending)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._end(stream, Ended(client_gone=True))
            return
        stream.pending = stream.pending[sent:]
        if stream.pending:
            return
        stream.blocked = False
        stream.last_data = now  # the idle timeout counts again from here
        self._stop_waiting(stream)
        self._wait_on(stream, upstream, select.EPOLLIN)

    async def _pump_task(self, stream: HubStream) -> None:
        """A stream whose ends are not both sockets, moved by a task of its own."""
        with trio.CancelScope() as scope:
            stream._pump = scope
            while stream in self._streams:
                try:
                    raw = await stream.upstream.receive(READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self._end(stream, _cut(f"connection lost: {exc}"))
                    return
                data = self._arrived(stream, raw, trio.current_time())
                if not data:
                    continue
                stream.blocked = True
                try:
                    await stream.client.send(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._end(stream, Ended(client_gone=True))
                    return
                stream.blocked = False
                stream.last_data = trio.current_time()

    async def _sweep_idle(self) -> None:
        while True:
            if not self._streams:
                # An idle proxy wakes for nothing of ours.
                self._first_stream = trio.Event()
                await self._first_stream.wait()
            await trio.sleep(SWEEP_S)
            now = trio.current_time()
            for stream in list(self._streams):
                if not stream.blocked and now - stream.last_data >= stream.idle:
                    silent = f"no data from the backend for {stream.idle:g}s"
                    self._end(stream, Ended(broken=UpstreamError(UpstreamFault.TIMEOUT, silent)))

    def _end(self, stream: HubStream, ended: Ended) -> None:
        task = stream._task
        self._remove(stream)
        if task is not None:
            trio.lowlevel.reschedule(task, outcome.Value(ended))

    def _remove(self, stream: HubStream) -> None:
        """Take `stream` out: nothing of it stays registered or running (its streams close
        later, their owners' business)."""
        if stream not in self._streams:
            return
        self._streams.discard(stream)
        stream._task = None
        self._stop_waiting(stream)
        if stream._pump is not None:
            stream._pump.cancel()
