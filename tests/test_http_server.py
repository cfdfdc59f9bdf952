"""The HTTP/1.1 server (app/http/server.py) that serves the proxy's port and the simulated
backend, driven over memory streams.

As hypercorn's `tests/trio/test_sanity.py` drives its server: a client writes raw bytes into
one end of `trio.testing.memory_stream_pair`, `serve_connection` serves the other; no port,
and `autojump_clock` wherever a timeout is the subject. Each request is also fed one byte at
a time (h11's `t_body_reader` habit) and must get the same answer. Covers: keep-alive,
pipelined requests answered in order, chunked request bodies, `Expect: 100-continue` (and a
413 instead of the 100 when Content-Length is over the limit), 431 for an oversized head,
400 for garbage, 408 for a head that trickles past the read timeout (and for a pipelined
head left unfinished behind an answer), an idle keep-alive closed after its timeout
(counted from the end of an answer, however long that took), `Connection: close` honoured,
HTTP/1.0 clients (kept alive when they ask, a streamed answer until close), absolute-form
targets, HEAD, a client that leaves cancelling its request and a pipelined one cancelling
nothing (over a socket pair: departures are watched on sockets), a handler's bug as a 500
that costs only its connection, and shutdown: idle connections closed, an answer in flight
finished and marked the last. Any bytes at all, then a close: HTTP/1.1 answers or just the
close, never an error in the server.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from app.errors import ClientError
from app.http.exchange import Exchange
from app.http.server import HttpServer
from app.http.streams import StreamBytes, byte_stream

Handler = Callable[[Exchange], Awaitable[None]]


async def echo(exchange: Exchange) -> None:
    """Answers with the method, path and body it read."""
    body = await exchange.read_body(1000)
    text = f"{exchange.method} {exchange.path} {body.decode()}".encode()
    await exchange.respond(200, [(b"content-type", b"text/plain")], text)


async def stream_three(exchange: Exchange) -> None:
    await exchange.read_body(1000)
    await exchange.start(200, [(b"content-type", b"text/event-stream")], b"a", complete=False)
    await exchange.write(b"b")
    await exchange.end(b"c")


class Client:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.received = b""

    async def send(self, data: bytes, byte_by_byte: bool = False) -> None:
        if not byte_by_byte:
            await self.stream.send_all(data)
            return
        for i in range(len(data)):
            await self.stream.send_all(data[i : i + 1])
            await trio.testing.wait_all_tasks_blocked()

    async def read_until_closed(self) -> bytes:
        while data := await self.stream.receive_some(65536):
            self.received += data
        return self.received

    async def read_until(self, marker: bytes, count: int = 1) -> bytes:
        while self.received.count(marker) < count:
            data = await self.stream.receive_some(65536)
            assert data, f"closed after {self.received!r}"
            self.received += data
        return self.received


@asynccontextmanager
async def connected(
    handler: Handler, **settings: float
) -> AsyncIterator[tuple[Client, HttpServer, trio.Event]]:
    """A client on a connection the server serves; the event is set when it has ended."""
    server = HttpServer(handler, **settings)  # type: ignore[arg-type]
    client_end, server_end = trio.testing.memory_stream_pair()
    ended = trio.Event()

    async def serve() -> None:
        await server.serve_connection(StreamBytes(server_end))
        ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        yield Client(client_end), server, ended
        nursery.cancel_scope.cancel()


def post(path: str, body: bytes, *headers: bytes) -> bytes:
    lines = [b"POST " + path.encode() + b" HTTP/1.1", b"host: x", *headers]
    if not any(h.lower().startswith(b"transfer-encoding") for h in headers):
        lines.append(b"content-length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    for byte_by_byte in (False, True):
        async with connected(echo) as (client, _, ended):
            await client.send(post("/one", b"1"), byte_by_byte)
            await client.read_until(b"POST /one 1")
            # Two requests in one write: answered one after the other, in order.
            await client.send(post("/two", b"22") + post("/three", b"333"), byte_by_byte)
            received = await client.read_until(b"HTTP/1.1 200 OK", 3)
            assert received.count(b"HTTP/1.1 200 OK") == 3
            assert received.index(b"POST /two 22") < received.index(b"POST /three 333")
            assert not ended.is_set()


async def test_a_chunked_request_body_is_decoded() -> None:
    chunked = b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n"
    for byte_by_byte in (False, True):
        async with connected(echo) as (client, _, _):
            await client.send(post("/c", chunked, b"transfer-encoding: chunked"), byte_by_byte)
            assert (await client.read_until(b"abcde")).endswith(b"POST /c abcde")


async def bounded(exchange: Exchange) -> None:
    """Reads at most 4 bytes of body; a ClientError is answered, as the proxy does."""
    try:
        body = await exchange.read_body(4)
    except ClientError as exc:
        await exchange.respond_error(exc)
        return
    await exchange.respond(200, [], body)


async def test_expect_100_continue_is_answered_before_the_body_and_refused_when_too_big() -> None:
    expect = b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n"
    async with connected(bounded) as (client, _, _):
        await client.send(expect % 2)
        assert (await client.read_until(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue\r\n")
        await client.send(b"ok")
        received = await client.read_until(b"\r\n\r\nok")
        assert b"\r\n\r\nHTTP/1.1 200 OK\r\n" in received and received.endswith(b"\r\n\r\nok")
    async with connected(bounded) as (client, _, ended):
        await client.send(expect % 5000)  # refused from its Content-Length: no 100 first
        received = await client.read_until_closed()
        assert received.startswith(b"HTTP/1.1 413 ") and b"connection: close" in received
        await ended.wait()


async def test_a_body_over_the_limit_is_413_and_the_connection_closes() -> None:
    for body, headers in (
        (b"12345", ()),
        (b"6\r\n123456\r\n0\r\n\r\n", (b"transfer-encoding: chunked",)),
    ):
        async with connected(bounded) as (client, _, ended):
            await client.send(post("/big", body, *headers))
            received = await client.read_until_closed()
            assert received.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n")
            assert b"connection: close" in received and b'"request_too_large"' in received
            await ended.wait()


async def test_malformed_and_oversized_heads_are_400_and_431() -> None:
    for request, status in (
        (b"GARBAGE\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\r\nx: " + b"a" * 20000, b"431"),
    ):
        async with connected(echo, max_head_bytes=16384) as (client, _, ended):
            await client.send(request)
            received = await client.read_until_closed()
            assert received.startswith(b"HTTP/1.1 " + status)
            body = json.loads(received.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["type"] == "invalid_request_error"
            await ended.wait()


async def test_a_trickling_head_is_408_after_the_read_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with connected(echo, read_timeout=5, keep_alive_timeout=60) as (client, _, ended):
        started = trio.current_time()
        await client.send(b"POST /slow HTTP/1.1\r\n")
        for _ in range(4):  # a header line a second: no wait is long, the head is
            await trio.sleep(1)
            await client.send(b"x: 1\r\n")
        received = await client.read_until_closed()
        assert received.startswith(b"HTTP/1.1 408 ")
        await ended.wait()
        assert trio.current_time() - started == 5


async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with connected(echo, keep_alive_timeout=75) as (client, _, ended):
        await client.send(post("/one", b"1"))
        await client.read_until(b"POST /one 1")
        answered = trio.current_time()
        assert await client.read_until_closed() == client.received  # nothing more was said
        await ended.wait()
        assert trio.current_time() - answered == 75


async def test_an_answer_longer_than_the_keep_alive_is_not_cut_and_idleness_counts_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow(exchange: Exchange) -> None:
        await exchange.read_body(1000)
        await trio.sleep(200)
        await exchange.respond(200, [], b"late")

    async with connected(slow, keep_alive_timeout=75, read_timeout=30) as (client, _, ended):
        await client.send(post("/slow", b""))
        await client.read_until(b"late")
        answered = trio.current_time()
        assert answered == 200
        await ended.wait()
        assert trio.current_time() - answered == 75


async def test_a_pipelined_head_left_unfinished_after_an_answer_is_408_after_the_read_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with connected(echo, keep_alive_timeout=75, read_timeout=5) as (client, _, ended):
        await client.send(post("/one", b"1") + b"POST /two HTTP/1.1\r\n")
        await client.read_until(b"POST /one 1")
        answered = trio.current_time()
        received = await client.read_until_closed()
        assert received.split(b"POST /one 1", 1)[1].startswith(b"HTTP/1.1 408 ")
        await ended.wait()
        assert trio.current_time() - answered == 5


async def test_an_http_1_0_client_gets_a_streamed_answer_until_close() -> None:
    async with connected(stream_three) as (client, _, ended):
        await client.send(b"POST /s HTTP/1.0\r\ncontent-length: 0\r\n\r\n")
        received = await client.read_until_closed()
        head, body = received.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head
        assert body == b"abc"
        await ended.wait()
    async with connected(stream_three) as (client, _, ended):
        await client.send(post("/s", b""))
        received = await client.read_until(b"0\r\n\r\n")
        assert received.endswith(b"\r\n\r\n1\r\na\r\n1\r\nb\r\n1\r\nc\r\n0\r\n\r\n")
        assert not ended.is_set()


async def test_an_http_1_0_client_that_asks_for_keep_alive_keeps_its_connection() -> None:
    keep = b"connection: keep-alive"
    for byte_by_byte in (False, True):
        async with connected(echo) as (client, _, ended):
            request = b"POST /a HTTP/1.0\r\n%b\r\ncontent-length: 1\r\n\r\n1" % keep
            await client.send(request, byte_by_byte)
            await client.send(request.replace(b"/a", b"/b"), byte_by_byte)
            received = await client.read_until(b"POST /b 1")
            assert received.count(keep) == 2 and b"POST /a 1" in received
            assert not ended.is_set()
    # A streamed answer has no length to end it by: it runs until close all the same.
    async with connected(stream_three) as (client, _, ended):
        await client.send(b"POST /s HTTP/1.0\r\n%b\r\ncontent-length: 0\r\n\r\n" % keep)
        received = await client.read_until_closed()
        assert b"connection: close" in received and received.endswith(b"\r\n\r\nabc")
        await ended.wait()


async def test_an_absolute_form_target_is_served_by_its_path() -> None:
    async with connected(echo) as (client, _, _):
        await client.send(post("http://proxy.example:8000/v1/models?x=1", b"1"))
        await client.read_until(b"POST /v1/models 1")
        await client.send(post("HTTP://proxy.example", b"2"))
        await client.read_until(b"POST / 2")
        await client.send(post("ftp://proxy.example/x", b"3"))  # no route has an empty path
        await client.read_until(b"POST  3")


async def test_head_gets_the_headers_without_the_body() -> None:
    async def health(exchange: Exchange) -> None:
        await exchange.respond_json(200, {"status": "ok"})

    async with connected(health) as (client, _, _):
        await client.send(b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n")
        received = await client.read_until(b"\r\n\r\n")
        assert b"content-length: 15" in received and received.endswith(b"\r\n\r\n")
        await client.send(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await client.read_until(b'{"status":"ok"}')).endswith(b'{"status":"ok"}')


@asynccontextmanager
async def connected_socket(handler: Handler) -> AsyncIterator[tuple[trio.SocketStream, trio.Event]]:
    """A client on a socket pair the server serves, departures watched as `serve` does."""
    server = HttpServer(handler)
    client_socket, server_socket = trio.socket.socketpair()
    ended = trio.Event()

    async def serve() -> None:
        await server.serve_connection(byte_stream(trio.SocketStream(server_socket)))
        ended.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(server.departures.run)
        nursery.start_soon(serve)
        yield trio.SocketStream(client_socket), ended
        nursery.cancel_scope.cancel()


async def test_a_client_that_leaves_cancels_its_request() -> None:
    cancelled = trio.Event()

    async def forever(exchange: Exchange) -> None:
        await exchange.read_body(1000)
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async with connected_socket(forever) as (client, ended):
        await client.send_all(post("/wait", b"{}"))
        await trio.testing.wait_all_tasks_blocked()
        await client.aclose()
        await cancelled.wait()
        await ended.wait()


async def test_a_pipelined_request_waits_and_cancels_nothing() -> None:
    release = trio.Event()

    async def slow_echo(exchange: Exchange) -> None:
        await release.wait()
        await echo(exchange)

    async with connected_socket(slow_echo) as (socket_client, ended):
        client = Client(socket_client)
        await client.send(post("/one", b"1"))
        await trio.testing.wait_all_tasks_blocked()
        await client.send(post("/two", b"2"))  # while the first is being answered
        await trio.testing.wait_all_tasks_blocked()
        release.set()
        received = await client.read_until(b"POST /two 2")
        assert received.index(b"POST /one 1") < received.index(b"POST /two 2")
        assert not ended.is_set()


async def test_a_handler_bug_is_a_500_that_costs_only_its_connection() -> None:
    async def buggy(exchange: Exchange) -> None:
        if exchange.path == "/bug":
            raise RuntimeError("a bug")
        await echo(exchange)

    async with connected(buggy) as (client, _, ended):
        await client.send(post("/bug", b""))
        received = await client.read_until_closed()
        assert received.startswith(b"HTTP/1.1 500 ") and b'"internal_error"' in received
        await ended.wait()
    async with connected(buggy) as (client, _, _):
        await client.send(post("/fine", b"ok"))
        assert (await client.read_until(b"POST /fine ok")).endswith(b"POST /fine ok")


async def test_shutdown_closes_idle_connections_and_finishes_answers_in_flight() -> None:
    release = trio.Event()

    async def slow(exchange: Exchange) -> None:
        await exchange.read_body(1000)
        await release.wait()
        await exchange.respond(200, [], b"done")

    server = HttpServer(slow)
    async with trio.open_nursery() as nursery:
        idle_client, idle_end = trio.testing.memory_stream_pair()
        busy_client, busy_end = trio.testing.memory_stream_pair()
        nursery.start_soon(server.serve_connection, StreamBytes(idle_end))
        nursery.start_soon(server.serve_connection, StreamBytes(busy_end))
        await busy_client.send_all(post("/busy", b""))
        await trio.testing.wait_all_tasks_blocked()
        assert server.answering == 1
        server.close()
        assert await Client(idle_client).read_until_closed() == b""
        release.set()
        await server.wait_idle()
        received = await Client(busy_client).read_until_closed()
        assert received.startswith(b"HTTP/1.1 200 ") and b"connection: close" in received
        assert received.endswith(b"done")


async def test_a_client_that_asks_to_close_gets_its_answer_then_the_close() -> None:
    async with connected(echo) as (client, _, ended):
        await client.send(post("/last", b"1", b"connection: close"))
        received = await client.read_until_closed()
        assert received.startswith(b"HTTP/1.1 200 OK\r\n") and b"connection: close" in received
        assert received.endswith(b"POST /last 1")
        await ended.wait()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                b"POST /x HTTP/1.1\r\n",
                b"GET / HTTP/1.0\r\n",
                b"host: x\r\n",
                b"content-length: 3\r\n",
                b"content-length: 99999999999999999999\r\n",
                b"transfer-encoding: chunked\r\n",
                b"expect: 100-continue\r\n",
                b"connection: close\r\n",
                b"\r\n",
                b"3\r\nabc\r\n0\r\n\r\n",
                b"abc",
                b" x",
                b"\x00\xff",
            ]
        )
        | st.binary(max_size=12),
        max_size=12,
    )
)
def test_any_bytes_get_answers_or_a_close_and_never_break_the_server(parts: list[bytes]) -> None:
    """Whatever a client sends and then closes, the server answers in HTTP/1.1 (zero or more
    whole responses), or closes, and its connection task ends without an error."""

    async def main() -> bytes:
        server = HttpServer(echo)
        client_end, server_end = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_connection, StreamBytes(server_end))
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await client_end.send_all(b"".join(parts))
                await client_end.send_eof()
            return await Client(client_end).read_until_closed()

    received = trio.run(main)
    assert received == b"" or re.match(rb"HTTP/1\.1 [1-5][0-9][0-9] ", received)
