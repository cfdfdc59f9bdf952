"""The relay hub (app/http/relay_hub.py): streamed answers relayed by one task, over real
sockets (the hub waits on socket descriptors itself, so memory streams cannot stand in).

Each test wires `relay` as the proxy does: a backend end and a client end, each a Unix
socket pair whose far side the test drives with raw HTTP bytes. Covers: events arrive
whole and in order and the stream leaves the hub when the body ends; more streams than one
batch at once; a slow client holds the backend back (bounded bytes in flight, nothing
lost); a client that is gone ends the relay with ClientGone; a backend that breaks off gets
the client an SSE error event and [DONE]; a silent backend is ended between its idle
timeout and one sweep later; a cancelled request takes its stream out; the hub's end ends
the streams still in it.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import h11
import trio
import trio.testing

from app.errors import UpstreamFault
from app.http.client import UpstreamPool, UpstreamResponse
from app.http.exchange import ClientGone, Exchange
from app.http.relay_hub import READ_SIZE, SWEEP_S, RelayHub
from app.http.streams import byte_stream
from app.proxy.relay import Passage
from tests.fakes import read_exchange, relay

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def event(i: int) -> bytes:
    return b'data: {"token": %d}\n\n' % i


def socket_pair(buffer_bytes: int | None = None) -> tuple[trio.SocketStream, trio.SocketStream]:
    ours, theirs = socket.socketpair()
    if buffer_bytes is not None:
        for sock in (ours, theirs):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    return (
        trio.SocketStream(trio.socket.from_stdlib_socket(ours)),
        trio.SocketStream(trio.socket.from_stdlib_socket(theirs)),
    )


@dataclass
class Wired:
    """One request in the middle of its relay: the far ends the test plays."""

    backend: trio.SocketStream  # the backend's side of the upstream connection
    client: trio.SocketStream  # the client's side of its connection
    response: UpstreamResponse
    exchange: Exchange


@asynccontextmanager
async def wired(nursery: trio.Nursery, buffer_bytes: int | None = None) -> AsyncIterator[Wired]:
    """A request read by the proxy and a backend's head on its way: ready for `relay`."""
    upstream_end, backend = socket_pair(buffer_bytes)
    client_end, client = socket_pair(buffer_bytes)

    async def open_stream(host: str, port: int) -> trio.abc.Stream:
        return upstream_end

    pool = UpstreamPool(connect_timeout=5, max_connections=4, open_stream=open_stream)
    await client.send_all(REQUEST)
    exchange = await read_exchange(byte_stream(client_end), trio.current_time() + 5)
    assert await exchange.read_body(100) == b"{}"
    await backend.send_all(HEAD)
    response = await pool.request("http://backend:8000", "/v1/chat/completions", [], b"{}")
    await backend.receive_some(65536)  # the request the pool sent
    yield Wired(backend, client, response, exchange)


async def read_answer(client: trio.SocketStream) -> tuple[int, bytes]:
    """The status and the whole body of the answer the client receives."""
    protocol = h11.Connection(h11.CLIENT)
    protocol.send(h11.Request(method="POST", target="/", headers=[(b"host", b"x")]))
    status, body = 0, []
    while True:
        got = protocol.next_event()
        if got is h11.NEED_DATA:
            protocol.receive_data(bytes(await client.receive_some(65536)))
        elif isinstance(got, h11.Response):
            status = got.status_code
        elif isinstance(got, h11.Data):
            body.append(bytes(got.data))
        elif isinstance(got, h11.EndOfMessage):
            return status, b"".join(body)


async def relay_into(result: list[Passage], w: Wired, hub: RelayHub, idle: float = 30) -> None:
    """Relay `w`'s answer through `hub`; what `relay` returned goes into `result`."""
    result.append(await relay(w.response, w.exchange, [], idle=idle, hub=hub))


@asynccontextmanager
async def running_hub() -> AsyncIterator[tuple[RelayHub, trio.Nursery]]:
    async with trio.open_nursery() as nursery:
        hub = RelayHub()
        await nursery.start(hub.run)
        yield hub, nursery
        nursery.cancel_scope.cancel()


async def test_events_arrive_whole_and_the_stream_leaves_when_the_body_ends() -> None:
    events = [event(i) for i in range(20)]
    async with running_hub() as (hub, nursery), wired(nursery) as w:
        result: list[Passage] = []

        nursery.start_soon(relay_into, result, w, hub)
        await trio.testing.wait_all_tasks_blocked()
        assert len(hub) == 1  # the body is the hub's now
        for data in events:
            await w.backend.send_all(chunk(data))
        await w.backend.send_all(b"0\r\n\r\n")
        assert await read_answer(w.client) == (200, b"".join(events))
        await trio.testing.wait_all_tasks_blocked()
        assert len(hub) == 0 and result[0].broken_by is None
        assert result[0].tail.endswith(events[-1])


async def test_more_streams_than_one_batch_are_all_relayed() -> None:
    count = 150
    async with running_hub() as (hub, nursery), AsyncExitStack() as stack:
        ends = []
        for _ in range(count):
            w = await stack.enter_async_context(wired(nursery))
            nursery.start_soon(relay, w.response, w.exchange, [], 30, hub)
            ends.append(w)
        await trio.testing.wait_all_tasks_blocked()
        assert len(hub) == count
        for w in ends:  # every stream ready at once, then every stream ends at once
            await w.backend.send_all(chunk(event(1)) + chunk(event(2)))
        for w in ends:
            await w.backend.send_all(b"0\r\n\r\n")
        for w in ends:
            assert await read_answer(w.client) == (200, event(1) + event(2))


async def test_a_slow_client_holds_the_backend_back_and_loses_nothing() -> None:
    body = [event(i) * 50 for i in range(2000)]  # ~2 MB
    total = sum(len(chunk(data)) for data in body) + 5
    async with running_hub() as (hub, nursery), wired(nursery, buffer_bytes=16384) as w:
        sent = 0

        async def backend_writes() -> None:
            nonlocal sent
            for data in body:
                framed = chunk(data)
                await w.backend.send_all(framed)
                sent += len(framed)
            await w.backend.send_all(b"0\r\n\r\n")
            sent += 5

        nursery.start_soon(relay, w.response, w.exchange, [], 30, hub)
        nursery.start_soon(backend_writes)
        await trio.testing.wait_all_tasks_blocked()
        # Nobody reads the client's side: the backend is held back once the sockets' small
        # buffers and the one read the hub keeps are full.
        in_flight_bound = 8 * 32768 + 2 * READ_SIZE
        assert 0 < sent < min(in_flight_bound, total)
        assert await read_answer(w.client) == (200, b"".join(body))
        assert sent == total


async def test_a_client_that_is_gone_ends_the_relay_with_client_gone() -> None:
    async with running_hub() as (hub, nursery), wired(nursery) as w:
        outcome: list[BaseException] = []

        async def relaying() -> None:
            try:
                await relay(w.response, w.exchange, [], idle=30, hub=hub)
            except ClientGone as exc:
                outcome.append(exc)

        nursery.start_soon(relaying)
        await w.backend.send_all(chunk(event(1)))
        await w.client.receive_some(65536)
        await w.client.aclose()
        await trio.testing.wait_all_tasks_blocked()
        await w.backend.send_all(chunk(event(2)))
        await trio.testing.wait_all_tasks_blocked()
        assert outcome and len(hub) == 0


async def test_a_backend_that_breaks_off_gets_the_client_an_error_event() -> None:
    async with running_hub() as (hub, nursery), wired(nursery) as w:
        result: list[Passage] = []

        nursery.start_soon(relay_into, result, w, hub)
        await w.backend.send_all(chunk(event(1)))
        await w.backend.aclose()  # mid-body: no last chunk
        status, body = await read_answer(w.client)
        assert status == 200 and body.startswith(event(1))
        assert b"backend_stream_broken" in body and body.endswith(b"data: [DONE]\n\n")
        await trio.testing.wait_all_tasks_blocked()
        assert result[0].broken_by is not None and "last chunk" in result[0].broken_by.detail


async def test_a_silent_backend_is_ended_within_a_sweep_of_its_idle_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_hub() as (hub, nursery), wired(nursery) as w:
        result: list[Passage] = []

        nursery.start_soon(relay_into, result, w, hub, 3)
        await w.backend.send_all(chunk(event(1)))
        await trio.testing.wait_all_tasks_blocked()
        silent_from = trio.current_time()
        status, body = await read_answer(w.client)
        silent = trio.current_time() - silent_from
        assert 3 <= silent <= 3 + SWEEP_S
        assert status == 200 and b"no data from the backend for 3s" in body
        await trio.testing.wait_all_tasks_blocked()
        assert result[0].broken_by is not None
        assert result[0].broken_by.fault is UpstreamFault.TIMEOUT
        assert result[0].broken_by.detail == "no data from the backend for 3s"


async def test_a_cancelled_request_takes_its_stream_out() -> None:
    async with running_hub() as (hub, nursery), wired(nursery) as w:
        async with trio.open_nursery() as request:
            request.start_soon(relay, w.response, w.exchange, [], 30, hub)
            await trio.testing.wait_all_tasks_blocked()
            assert len(hub) == 1
            request.cancel_scope.cancel()  # as the client leaving cancels its request
        assert len(hub) == 0
        # The hub goes on: the backend's next bytes are nobody's, and harmless.
        await w.backend.send_all(chunk(event(1)))
        await trio.testing.wait_all_tasks_blocked()


async def test_the_hubs_end_ends_the_streams_in_it() -> None:
    result: list[Passage] = []
    async with trio.open_nursery() as outer, wired(outer) as w:
        hub = RelayHub()
        async with trio.open_nursery() as hub_nursery:
            await hub_nursery.start(hub.run)

            outer.start_soon(relay_into, result, w, hub)
            await trio.testing.wait_all_tasks_blocked()
            assert len(hub) == 1
            hub_nursery.cancel_scope.cancel()
        status, body = await read_answer(w.client)
        assert status == 200 and b"the proxy is shutting down" in body
        outer.cancel_scope.cancel()
    assert result[0].broken_by is not None
    assert result[0].broken_by.detail == "the proxy is shutting down"
