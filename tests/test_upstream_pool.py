"""The forwarding client and the relay, driven over in-memory streams under a jumping clock.

No port and no real time (as hypercorn's own tests drive its server over
`trio.testing.memory_stream_pair`): each backend "connection" is a memory stream pair whose
far end is served by a small h11 server written for the test, the client of the relay is an
h11 client on another pair, and `autojump_clock` makes every timeout exact. Covers:
- a keep-alive connection the backend closed while idle: the next request is retried once
  on a fresh connection, and the backend sees it once; a fresh one is never retried;
- pool exhaustion: the request that finds every connection busy fails after exactly the
  connect timeout, and a freed connection is reused;
- a response head later than the first-byte timeout fails its exchange at exactly that
  timeout (the pool's one watcher task aborts the connection), without a retry;
- coalescing: what arrives from the backend in one read leaves in one write, a whole answer
  in a single write with its head, its connection back in the pool before that write;
- the idle timeout between chunks ends an event stream with an error event and [DONE],
  between `idle` and 1.1 x `idle` after the last byte; a body that is not an event stream
  ends without its end (the connection then closes) instead;
- a slow client: relaying waits for the client as long as it takes (back-pressure), and
  only silence from the backend counts against the idle timeout;
- the answer's tail, where its usage is, survives a long body;
- the check for a keep-alive socket closed while idle works on a real socket whose file
  descriptor is above 1023 (`select` refuses those; a proxy with 1,000 clients has them).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import h11
import pytest
import trio
import trio.testing

from app.errors import UpstreamError, UpstreamFault
from app.http.client import UpstreamPool, UpstreamResponse
from app.http.exchange import Exchange
from app.http.relay_hub import SWEEP_S, RelayHub
from app.http.streams import StreamBytes, byte_stream
from app.routing.usage import TAIL_BYTES, Usage, usage_from_tail
from tests.fakes import read_exchange, relay

BASE = "http://backend:8000"
Handler = Callable[[trio.abc.Stream, h11.Connection], Awaitable[None]]


class FakeBackend:
    """Opens memory-stream connections and serves each with `handler` in `nursery`."""

    def __init__(self, nursery: trio.Nursery, handler: Handler) -> None:
        self._nursery = nursery
        self.handler = handler
        self.connections = 0
        self.requests = 0

    async def open_stream(self, host: str, port: int) -> trio.abc.Stream:
        assert (host, port) == ("backend", 8000)
        self.connections += 1
        client, server = trio.testing.memory_stream_pair()
        self._nursery.start_soon(self._serve, server)
        return client

    async def _serve(self, stream: trio.abc.Stream) -> None:
        # A handler that closed the connection ends it.
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            await self._serve_requests(stream)

    async def _serve_requests(self, stream: trio.abc.Stream) -> None:
        protocol = h11.Connection(h11.SERVER)
        while True:
            event = await next_event(stream, protocol)
            if not isinstance(event, h11.Request):
                return
            while not isinstance(await next_event(stream, protocol), h11.EndOfMessage):
                pass
            self.requests += 1
            await self.handler(stream, protocol)
            if protocol.our_state is not h11.DONE:
                return
            protocol.start_next_cycle()


async def next_event(stream: trio.abc.Stream, protocol: h11.Connection) -> Any:
    while (event := protocol.next_event()) is h11.NEED_DATA:
        protocol.receive_data(bytes(await stream.receive_some(65536)))
    return event


async def send(stream: trio.abc.Stream, protocol: h11.Connection, *events: Any) -> None:
    await stream.send_all(b"".join(protocol.send(event) or b"" for event in events))


def head(length: int | None = None, event_stream: bool = False) -> h11.Response:
    headers = [(b"content-type", b"text/event-stream" if event_stream else b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    else:
        headers.append((b"transfer-encoding", b"chunked"))
    return h11.Response(status_code=200, headers=headers)


async def answer_ok(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
    await send(stream, protocol, head(2), h11.Data(data=b"{}"), h11.EndOfMessage())


async def answer_then_close(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
    await answer_ok(stream, protocol)
    await stream.aclose()  # the backend drops the idle keep-alive connection


async def body_of(response: UpstreamResponse) -> bytes:
    """The whole body, then the connection given back (closed if the body broke off)."""
    try:
        pieces = [response.take_arrived()]
        while not response.complete:
            pieces.append(response.decode(await response.receive()))
    finally:
        await response.release()
    return b"".join(pieces)


async def read_all(pool: UpstreamPool) -> bytes:
    return await body_of(await pool.request(BASE, "/v1/completions", [], b"{}"))


def new_pool(backend: FakeBackend, max_connections: int = 1) -> UpstreamPool:
    return UpstreamPool(
        connect_timeout=3, max_connections=max_connections, open_stream=backend.open_stream
    )


async def test_a_dead_keep_alive_connection_is_retried_on_a_fresh_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, answer_then_close)
        pool = new_pool(backend, 4)
        assert await read_all(pool) == b"{}"
        await trio.testing.wait_all_tasks_blocked()  # the backend has closed its end
        backend.handler = answer_ok
        assert await read_all(pool) == b"{}"
        assert (backend.connections, backend.requests) == (2, 2)
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_a_dead_fresh_connection_is_not_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def close_at_once(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, close_at_once)
        with pytest.raises(UpstreamError):
            await read_all(new_pool(backend, 4))
        assert backend.connections == 1  # the backend saw the request: no second try
        nursery.cancel_scope.cancel()


async def test_an_exhausted_pool_fails_after_exactly_the_connect_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    release = trio.Event()

    async def hold_the_body(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        await send(stream, protocol, head(2))
        await release.wait()
        await send(stream, protocol, h11.Data(data=b"{}"), h11.EndOfMessage())

    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, hold_the_body)
        pool = new_pool(backend)
        held = await pool.request(BASE, "/v1/completions", [], b"{}")
        started = trio.current_time()
        with pytest.raises(UpstreamError, match="every upstream connection is busy"):
            await pool.request(BASE, "/v1/completions", [], b"{}")
        assert trio.current_time() - started == 3
        release.set()
        assert await body_of(held) == b"{}"
        assert await read_all(pool) == b"{}"  # the freed connection serves the next request
        assert backend.connections == 1
        nursery.cancel_scope.cancel()


async def test_a_late_head_fails_at_exactly_the_first_byte_timeout_and_is_not_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    delay = [0.0]

    async def answer_after_delay(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        await trio.sleep(delay[0])
        await answer_ok(stream, protocol)

    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, answer_after_delay)
        pool = UpstreamPool(
            connect_timeout=3,
            first_byte_timeout=5,
            max_connections=1,
            open_stream=backend.open_stream,
        )
        await nursery.start(pool.expire_late_heads)
        delay[0] = 4.9
        assert await read_all(pool) == b"{}"  # in time, on a connection kept for reuse
        delay[0] = 10
        started = trio.current_time()
        with pytest.raises(UpstreamError, match="no response within 5s") as info:
            await read_all(pool)
        assert info.value.fault is UpstreamFault.TIMEOUT and trio.current_time() - started == 5
        assert backend.requests == 2  # the late request, on a reused connection, is not resent
        delay[0] = 0
        assert await read_all(pool) == b"{}"  # its slot was given back
        assert backend.connections == 2  # the late connection was closed, not reused
        assert not pool._heads_due  # nothing is kept for answered or failed exchanges
        nursery.cancel_scope.cancel()


class CountingBytes(StreamBytes):
    """The relay's client side: counts the writes the proxy makes."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        super().__init__(stream)
        self.sends = 0

    async def send(self, data: bytes) -> None:
        self.sends += 1
        await super().send(data)


class Client:
    """The relay's client: an h11 client reading what the proxy writes, `delay` per read."""

    def __init__(self, stream: trio.abc.Stream, delay: float = 0.0) -> None:
        self.stream = stream
        self.delay = delay
        self.protocol = h11.Connection(h11.CLIENT)
        self.protocol.send(h11.Request(method="POST", target="/", headers=[(b"host", b"x")]))

    async def answer(self) -> tuple[int, bytes]:
        status = 0
        body = []
        while True:
            try:
                event = self.protocol.next_event()
            except h11.RemoteProtocolError:  # the answer broke off
                return status, b"".join(body)
            if event is h11.NEED_DATA:
                await trio.sleep(self.delay)
                data = await self.stream.receive_some(65536)
                self.protocol.receive_data(bytes(data))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, b"".join(body)


@contextlib.asynccontextmanager
async def client_exchange(
    lockstep: bool = False, delay: float = 0.0
) -> AsyncIterator[tuple[Exchange, CountingBytes, Client]]:
    """An exchange whose request was read, and the client at the other end."""
    pair = trio.testing.lockstep_stream_pair() if lockstep else trio.testing.memory_stream_pair()
    client_end, proxy_end = pair
    proxy_bytes = CountingBytes(proxy_end)
    async with trio.open_nursery() as nursery:
        request = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
        nursery.start_soon(client_end.send_all, request)
        exchange = await read_exchange(proxy_bytes, trio.current_time() + 1)
        assert await exchange.read_body(100) == b""
        yield exchange, proxy_bytes, Client(client_end, delay)
        nursery.cancel_scope.cancel()


async def relayed_answer(
    handler: Handler, idle: float = 1.0, delay: float = 0.0
) -> tuple[Any, tuple[int, bytes], int, FakeBackend]:
    """Relay one answer of `handler`'s: (what relay returned or raised, what the client got,
    how many writes the proxy made, the backend)."""
    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, handler)
        pool = new_pool(backend)
        hub = RelayHub()
        await nursery.start(hub.run)
        async with client_exchange(lockstep=delay > 0, delay=delay) as (exchange, counted, client):
            response = await pool.request(BASE, "/v1/completions", [], b"{}")
            outcome: Any
            async with trio.open_nursery() as both:
                answer: list[tuple[int, bytes]] = []

                async def read_answer() -> None:
                    answer.append(await client.answer())

                both.start_soon(read_answer)
                try:
                    outcome = await relay(response, exchange, [], idle, hub)
                    if not exchange.complete:
                        await counted.aclose()  # as the server does with an unfinished answer
                finally:
                    await response.release()
            sends = counted.sends
        nursery.cancel_scope.cancel()
    return outcome, answer[0], sends, backend


EVENTS = [b"data: %d\n\n" % i for i in range(3)] + [b"data: [DONE]\n\n"]


async def test_a_whole_answer_leaves_in_one_write_and_its_connection_is_reused() -> None:
    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, answer_ok)
        pool = new_pool(backend)
        hub = RelayHub()
        await nursery.start(hub.run)
        for _ in range(2):
            async with client_exchange() as (exchange, counted, client):
                response = await pool.request(BASE, "/v1/completions", [], b"{}")
                relayed = await relay(response, exchange, [], 1.0, hub)
                # Given back before the client's write: nothing is left to close.
                assert response.complete
                assert relayed.broken_by is None and relayed.tail == b"{}"
                assert await client.answer() == (200, b"{}")
                assert counted.sends == 1
        assert (backend.connections, backend.requests) == (1, 2)
        nursery.cancel_scope.cancel()


async def test_what_arrives_in_one_read_leaves_in_one_write() -> None:
    async def events_then_end(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        data = [h11.Data(data=event) for event in EVENTS[:3]]
        await send(stream, protocol, head(event_stream=True), *data)
        await trio.testing.wait_all_tasks_blocked()  # the relay has sent what it had
        await send(stream, protocol, h11.Data(data=EVENTS[3]), h11.EndOfMessage())

    relayed, answer, sends, _ = await relayed_answer(events_then_end)
    assert relayed.broken_by is None
    assert answer == (200, b"".join(EVENTS))
    assert sends == 2  # head and three events; the last event and the end


async def test_a_silent_backend_ends_the_stream_after_the_idle_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def one_event_then_silence(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        await send(stream, protocol, head(event_stream=True), h11.Data(data=b"data: 1\n\n"))
        await trio.sleep(0.5)
        await send(stream, protocol, h11.Data(data=b"data: 2\n\n"))
        await trio.sleep_forever()

    started = trio.current_time()
    relayed, (status, body), _, _ = await relayed_answer(one_event_then_silence)
    assert relayed.broken_by is not None
    assert relayed.broken_by.fault is UpstreamFault.TIMEOUT
    assert relayed.broken_by.detail == "no data from the backend for 1s"
    silent = trio.current_time() - started - 0.5
    assert 1.0 <= silent <= 1.0 + SWEEP_S  # the hub's sweep, as for sockets
    assert status == 200 and body.startswith(b"data: 1\n\ndata: 2\n\n")
    assert b"backend_stream_broken" in body and body.endswith(b"data: [DONE]\n\n")


async def test_a_body_cut_short_that_is_not_a_stream_is_a_broken_answer() -> None:
    async def half_a_body(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        await send(stream, protocol, head(10), h11.Data(data=b'{"a":'))
        await stream.aclose()

    outcome, (status, body), _, _ = await relayed_answer(half_a_body)
    assert outcome.broken_by is not None and "short of its length" in outcome.broken_by.detail
    assert (status, body) == (200, b'{"a":')  # and the client's connection was closed


async def test_a_slow_client_is_waited_for_and_the_stream_ends_cleanly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def stream_events(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        await send(stream, protocol, head(event_stream=True))
        for event in EVENTS:
            await send(stream, protocol, h11.Data(data=event))
            await trio.sleep(0.1)
        await send(stream, protocol, h11.EndOfMessage())

    relayed, answer, _, _ = await relayed_answer(stream_events, idle=1.0, delay=5.0)
    assert relayed.broken_by is None
    assert answer == (200, b"".join(EVENTS))


async def test_the_tail_keeps_the_usage_at_the_end_of_a_long_answer() -> None:
    usage = (
        b'data: {"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":4,'
        b'"prompt_tokens_details":{"cached_tokens":16}}}\n\ndata: [DONE]\n\n'
    )

    async def long_answer(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        await send(stream, protocol, head(event_stream=True), h11.Data(data=b"x" * 10_000))
        for piece in (usage[:40], usage[40:]):
            await trio.testing.wait_all_tasks_blocked()
            await send(stream, protocol, h11.Data(data=piece))
        await send(stream, protocol, h11.EndOfMessage())

    relayed, (_, body), _, _ = await relayed_answer(long_answer)
    assert len(relayed.tail) == TAIL_BYTES and body.endswith(usage)
    assert usage_from_tail(relayed.tail) == Usage(30, 4, 16)


async def test_an_idle_socket_above_descriptor_1023_is_checked() -> None:
    ours, theirs = socket.socketpair()
    high = os.dup2(ours.fileno(), 1500)
    ours.close()
    stream = byte_stream(
        trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=high)))
    )
    try:
        assert not stream.closed_by_peer()
        theirs.close()
        assert stream.closed_by_peer()
    finally:
        await stream.aclose()
