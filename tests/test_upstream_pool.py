"""The forwarding client and relay, driven over in-memory streams under a jumping clock.

No port and no real time (as hypercorn's own tests drive its server over
`trio.testing.memory_stream_pair`): each "connection" is a memory stream pair whose far end
is served by a small h11 server written for the test, and `autojump_clock` makes every
timeout exact. Covers:
- a keep-alive connection the backend closed while idle: the next request is retried once
  on a fresh connection, and the backend sees it once;
- pool exhaustion: the request that finds every connection busy fails after exactly the
  connect timeout, and a freed connection is reused;
- the idle timeout between chunks ends an event stream with an error event and [DONE];
- a slow client: relaying waits for the client as long as it takes (back-pressure), and
  only silence from the backend counts against the idle timeout;
- a body that arrived whole is relayed as the response start and one last body message,
  and its connection goes back to the pool; a body still arriving is relayed piece by
  piece, its end a message of its own;
- the check for a keep-alive socket closed while idle works on a real socket whose file
  descriptor is above 1023 (`select` refuses those; a proxy with 1,000 clients has them).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import pytest
import trio
import trio.testing

from app.asgi import Message
from app.proxy.forward import relay
from app.proxy.upstream import UpstreamError, UpstreamPool, _Connection

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
        with contextlib.suppress(trio.ClosedResourceError):
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


async def read_all(pool: UpstreamPool) -> bytes:
    response = await pool.request(BASE, "/v1/completions", [], b"{}")
    body = b"".join([chunk async for chunk in response.chunks()])
    await response.aclose()
    return body


async def test_a_dead_keep_alive_connection_is_retried_on_a_fresh_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, answer_then_close)
        pool = UpstreamPool(connect_timeout=3, max_connections=4, open_stream=backend.open_stream)
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
        pool = UpstreamPool(connect_timeout=3, max_connections=4, open_stream=backend.open_stream)
        with pytest.raises(UpstreamError):
            await read_all(pool)
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
        pool = UpstreamPool(connect_timeout=3, max_connections=1, open_stream=backend.open_stream)
        held = await pool.request(BASE, "/v1/completions", [], b"{}")
        started = trio.current_time()
        with pytest.raises(UpstreamError, match="every upstream connection is busy"):
            await pool.request(BASE, "/v1/completions", [], b"{}")
        assert trio.current_time() - started == 3
        release.set()
        assert b"".join([chunk async for chunk in held.chunks()]) == b"{}"
        await held.aclose()
        assert await read_all(pool) == b"{}"  # the freed connection serves the next request
        assert backend.connections == 1
        nursery.cancel_scope.cancel()


def collecting_send(log: list[Message], delay: float = 0.0) -> Callable[[Message], Awaitable[None]]:
    async def client_send(message: Message) -> None:
        await trio.sleep(delay)  # a client that takes its time reading
        log.append(message)

    return client_send


async def test_a_silent_backend_ends_the_stream_after_exactly_the_idle_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def one_event_then_silence(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        await send(stream, protocol, head(event_stream=True), h11.Data(data=b"data: 1\n\n"))
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, one_event_then_silence)
        pool = UpstreamPool(connect_timeout=3, max_connections=1, open_stream=backend.open_stream)
        response = await pool.request(BASE, "/v1/completions", [], b"{}")
        sent: list[Message] = []
        started = trio.current_time()
        broken = await relay(response, collecting_send(sent), [], idle=1.0)
        await response.aclose()
        assert broken is not None and "no data from the backend for 1s" in broken
        assert trio.current_time() - started == 1
        bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
        assert bodies[0] == b"data: 1\n\n"
        assert b"backend_stream_broken" in bodies[-1] and bodies[-1].endswith(b"[DONE]\n\n")
        nursery.cancel_scope.cancel()


async def test_a_slow_client_is_waited_for_and_the_stream_ends_cleanly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    chunks = [b"data: %d\n\n" % i for i in range(3)] + [b"data: [DONE]\n\n"]

    async def stream_four_events(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        events = [h11.Data(data=chunk) for chunk in chunks]
        await send(stream, protocol, head(event_stream=True), *events, h11.EndOfMessage())

    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, stream_four_events)
        pool = UpstreamPool(connect_timeout=3, max_connections=1, open_stream=backend.open_stream)
        response = await pool.request(BASE, "/v1/completions", [], b"{}")
        sent: list[Message] = []
        broken = await relay(response, collecting_send(sent, delay=5.0), [], idle=1.0)
        await response.aclose()
        assert broken is None
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert body == b"".join(chunks)
        assert sent[-1]["more_body"] is False
        nursery.cancel_scope.cancel()


def ending_send(
    log: list[Message], request: trio.CancelScope
) -> Callable[[Message], Awaitable[None]]:
    """As the proxy's `send`: once the client has the last byte, the server reports the
    exchange over and the request's scope is cancelled."""

    async def client_send(message: Message) -> None:
        log.append(message)
        if message.get("more_body") is False:
            request.cancel()
            await trio.lowlevel.checkpoint()

    return client_send


async def test_a_whole_answer_is_one_last_body_message_and_its_connection_is_reused() -> None:
    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, answer_ok)
        pool = UpstreamPool(connect_timeout=3, max_connections=1, open_stream=backend.open_stream)
        for _ in range(2):
            response = await pool.request(BASE, "/v1/completions", [], b"{}")
            sent: list[Message] = []
            with trio.CancelScope() as request_scope:
                try:
                    await relay(response, ending_send(sent, request_scope), [], idle=1.0)
                finally:
                    await response.aclose()
            assert [(m["type"], m.get("body"), m.get("more_body")) for m in sent] == [
                ("http.response.start", None, None),
                ("http.response.body", b"{}", False),
            ]
        assert (backend.connections, backend.requests) == (1, 2)
        nursery.cancel_scope.cancel()


async def test_a_body_still_arriving_ends_with_a_message_of_its_own() -> None:
    async def two_reads(stream: trio.abc.Stream, protocol: h11.Connection) -> None:
        await send(stream, protocol, head(event_stream=True), h11.Data(data=b"data: 1\n\n"))
        await trio.testing.wait_all_tasks_blocked()  # the relay has sent the first event
        await send(stream, protocol, h11.EndOfMessage())

    async with trio.open_nursery() as nursery:
        backend = FakeBackend(nursery, two_reads)
        pool = UpstreamPool(connect_timeout=3, max_connections=1, open_stream=backend.open_stream)
        response = await pool.request(BASE, "/v1/completions", [], b"{}")
        sent: list[Message] = []
        assert await relay(response, collecting_send(sent), [], idle=1.0) is None
        await response.aclose()
        bodies = [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]
        assert bodies == [(b"data: 1\n\n", True), (b"", False)]
        nursery.cancel_scope.cancel()


async def test_an_idle_socket_above_descriptor_1023_is_checked() -> None:
    ours, theirs = socket.socketpair()
    high = os.dup2(ours.fileno(), 1500)
    ours.close()
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=high)))
    connection = _Connection(stream)
    try:
        assert not connection.closed_while_idle()
        theirs.close()
        assert connection.closed_while_idle()
    finally:
        await connection.close()
