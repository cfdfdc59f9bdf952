"""The endpoint-picker door's gRPC server (app/epp/grpc_server.py, health.py) over memory
streams: no port, no real clock, the h2 `Client` of tests/grpc_client.py on the other end.

Covered: calls echoed side by side on one connection; what a handler's ending becomes
(return -> OK, GrpcError -> its status, any other exception -> INTERNAL, logged, the
connection serving on); a client's reset cancelling its handler; garbage closing the
connection; grpc-timeout (on trio's autojump clock); flow control against a slow peer: a
peer that grants no window and one that stops reading both stop the handler's sends, and
what waits for them stays bounded; many calls reset at random while others are answered,
with no frame torn. Health: Check (NOT_FOUND for an unknown name, INVALID_ARGUMENT for bytes
that are not a request), readiness following `set_ready`, Watch sending each change.
Synchronisation is `wait_all_tasks_blocked`: everything that can happen has.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from h2.events import ConnectionTerminated
from h2.settings import SettingCodes

from app.epp.grpc_server import OUTBOUND_HIGH_WATER, Handler, MessageStream, serve_connection
from app.epp.grpc_wire import GrpcError, Limits, StatusCode
from app.epp.health import (
    CHECK_PATH,
    EXT_PROC_SERVICE,
    WATCH_PATH,
    HealthService,
    ServingStatus,
)
from app.epp.messages import HealthCheckRequest, HealthCheckResponse
from tests.grpc_client import ECHO, Client, Response, grpc_headers


class Peer:
    """The Client on the test's end of a stream pair; `reading` can be paused."""

    def __init__(self, stream: trio.abc.Stream, client: Client) -> None:
        self.stream = stream
        self.client = client
        self.eof = False
        self.reading = trio.Event()
        self.reading.set()
        self.writing = trio.Lock()

    async def flush(self) -> None:
        async with self.writing:  # the test and the read loop both write
            data = self.client.data_to_send()
            if data:
                await self.stream.send_all(data)

    async def read_forever(self) -> None:
        while True:
            await self.reading.wait()
            data = await self.stream.receive_some(1 << 20)
            if not data:
                self.eof = True
                return
            self.client.receive(data)
            await self.flush()  # acknowledgements, SETTINGS ACK

    async def settle(self) -> None:
        """Send what the client queued, then wait until nothing more can happen."""
        await self.flush()
        await trio.testing.wait_all_tasks_blocked()

    async def call(self, path: str, *messages: bytes) -> Response:
        stream_id = self.client.start(path)
        for message in messages:
            self.client.send(stream_id, message)
        self.client.end(stream_id)
        await self.settle()
        return self.client.responses[stream_id]


@asynccontextmanager
async def serving(
    handlers: dict[str, Handler],
    limits: Limits | None = None,
    settings: dict[SettingCodes | int, int] | None = None,
    pair: Callable[[], tuple[trio.abc.Stream, trio.abc.Stream]] = trio.testing.memory_stream_pair,
) -> AsyncIterator[Peer]:
    client_end, server_end = pair()
    peer = Peer(client_end, Client(settings))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_connection, server_end, handlers, limits or Limits())
        nursery.start_soon(peer.read_forever)
        await peer.settle()
        yield peer
        nursery.cancel_scope.cancel()


async def echo(stream: MessageStream) -> None:
    while (message := await stream.receive()) is not None:
        await stream.send(message)


async def test_calls_are_answered_side_by_side_on_one_connection() -> None:
    async with serving({ECHO: echo}) as peer:
        client = peer.client
        first, second = client.start(), client.start()
        client.send(first, b"a1")
        client.send(second, b"b1")
        await peer.settle()
        assert client.responses[first].messages() == [b"a1"]
        client.send(second, b"b2", end=True)
        client.send(first, b"a2", end=True)
        await peer.settle()
        for stream_id, expected in ((first, [b"a1", b"a2"]), (second, [b"b1", b"b2"])):
            response = client.responses[stream_id]
            assert (response.messages(), response.status, response.ended) == (expected, 0, True)


async def test_the_handler_sees_the_request_headers() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def record(stream: MessageStream) -> None:
        seen.extend(stream.metadata)

    async with serving({ECHO: record}) as peer:
        stream_id = peer.client.start(headers=[*grpc_headers(), (b"x-request-id", b"r1")])
        peer.client.end(stream_id)
        await peer.settle()
        # Nothing sent: a Trailers-Only answer, the status in the headers.
        assert peer.client.responses[stream_id].headers[b"grpc-status"] == b"0"
    assert (b"x-request-id", b"r1") in seen and (b":path", ECHO.encode()) in seen


async def test_how_a_handler_ends_is_the_status_and_a_bug_costs_one_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def refuse(stream: MessageStream) -> None:
        await stream.send(b"partial")
        raise GrpcError(StatusCode.FAILED_PRECONDITION, "not now")

    async def crash(stream: MessageStream) -> None:
        raise ValueError("a bug")

    async def crash_in_nursery(stream: MessageStream) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(refuse, stream)

    handlers = {"/t/refuse": refuse, "/t/crash": crash, "/t/group": crash_in_nursery, ECHO: echo}
    async with serving(handlers) as peer:
        refused = await peer.call("/t/refuse")
        assert (refused.messages(), refused.status) == ([b"partial"], 9)
        assert refused.message == b"not now"
        with caplog.at_level(logging.ERROR, logger="sluice.epp.grpc"):
            crashed = await peer.call("/t/crash")
        assert (crashed.status, crashed.message) == (StatusCode.INTERNAL, b"internal error")
        assert "a bug" in caplog.text
        assert (await peer.call("/t/group")).status == StatusCode.FAILED_PRECONDITION
        assert (await peer.call(ECHO, b"still here")).messages() == [b"still here"]


async def test_a_client_reset_cancels_its_handler() -> None:
    cancelled = []

    async def wait_forever(stream: MessageStream) -> None:
        try:
            await stream.receive()
            await stream.receive()
        except trio.Cancelled:
            cancelled.append(True)
            raise

    async with serving({ECHO: wait_forever}) as peer:
        stream_id = peer.client.start()
        peer.client.send(stream_id, b"first")
        await peer.settle()
        peer.client.reset(stream_id)
        await peer.settle()
        assert cancelled == [True]
        assert peer.client.responses[stream_id].status is None  # nothing was sent after
        assert (await peer.call(ECHO, b"next")).status == 0


async def test_garbage_closes_the_connection_and_nothing_else() -> None:
    client_end, server_end = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_connection, server_end, {ECHO: echo})
        await client_end.send_all(b"GET / HTTP/1.1\r\nhost: epp\r\n\r\n")
        received = b""
        while data := await client_end.receive_some(1 << 16):
            received += data
    # The server's SETTINGS, then its GOAWAY (frame type 7), then the end of the stream.
    assert b"\x07\x00\x00\x00\x00\x00" in received


async def test_a_call_past_its_grpc_timeout_is_deadline_exceeded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow(stream: MessageStream) -> None:
        await trio.sleep(60)

    async with serving({ECHO: slow}) as peer:
        stream_id = peer.client.start(headers=grpc_headers(ECHO, grpc_timeout="2S"), end=True)
        await peer.flush()
        await trio.sleep(3)
        assert peer.client.responses[stream_id].status == StatusCode.DEADLINE_EXCEEDED


async def test_a_peer_that_grants_no_window_stops_the_handler() -> None:
    sent = []

    async def three(stream: MessageStream) -> None:
        for number in range(3):
            await stream.send(bytes([number]) * 800)
            sent.append(number)

    async with serving({ECHO: three}, settings={SettingCodes.INITIAL_WINDOW_SIZE: 1000}) as peer:
        peer.client.hold_acks = True
        stream_id = peer.client.start(end=True)
        await peer.settle()
        # The first message fitted the window, the second waits in `send`, within it.
        assert sent == [0]
        assert len(peer.client.responses[stream_id].data) == 1000
        peer.client.acknowledge(stream_id, 1000)
        peer.client.h2.increment_flow_control_window(5000, stream_id=stream_id)
        await peer.settle()
        assert sent == [0, 1, 2]
        assert peer.client.responses[stream_id].messages() == [bytes([n]) * 800 for n in range(3)]


async def test_a_peer_that_stops_reading_stops_the_handler_with_bounded_buffers() -> None:
    size, count = 64 * 1024, 40
    sent = []

    async def flood(stream: MessageStream) -> None:
        for number in range(count):
            await stream.send(b"f" * size)
            sent.append(number)

    wide = {SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1}
    pair = trio.testing.lockstep_stream_pair
    async with serving({ECHO: flood}, settings=wide, pair=pair) as peer:
        peer.client.h2.increment_flow_control_window(2**30)
        peer.reading = trio.Event()  # the peer stops reading
        stream_id = peer.client.start(end=True)
        await peer.settle()
        # What the peer has not read is at most the high-water mark and a message or two
        # (one taken from h2's buffer, one being written).
        received = len(peer.client.responses[stream_id].data)
        assert received < count * size
        assert len(sent) * size <= received + OUTBOUND_HIGH_WATER + 2 * (size + 5)
        peer.reading.set()
        await peer.settle()
        assert len(sent) == count
        assert peer.client.responses[stream_id].status == 0


async def test_random_resets_among_answers_tear_no_frame() -> None:
    rng = random.Random(2024)

    async def chatty(stream: MessageStream) -> None:
        while (message := await stream.receive()) is not None:
            for _ in range(3):
                await stream.send(message)
                await trio.lowlevel.checkpoint()

    async with serving({ECHO: chatty}) as peer:
        client = peer.client
        kept, dropped = [], []
        for _ in range(100):
            batch = [client.start() for _ in range(20)]
            for stream_id in batch:
                client.send(stream_id, b"m%d" % stream_id)
            await peer.flush()
            await trio.lowlevel.checkpoint()  # the server is mid-answer now and then
            for stream_id in batch:
                if rng.random() < 0.5:
                    client.reset(stream_id)
                    dropped.append(stream_id)
                else:
                    client.end(stream_id)
                    kept.append(stream_id)
            await peer.flush()
        await peer.settle()
        assert not any(isinstance(event, ConnectionTerminated) for event in client.events)
        for stream_id in kept:
            response = client.responses[stream_id]
            assert (response.messages(), response.status) == ([b"m%d" % stream_id] * 3, 0)
        assert dropped


# -- health --


def check_request(service: str) -> bytes:
    return HealthCheckRequest(service=service).SerializeToString()


def status_of(response: Response) -> list[int]:
    return [HealthCheckResponse.FromString(m).status for m in response.messages()]


async def test_health_check_answers_per_service_and_follows_readiness() -> None:
    health = HealthService()
    async with serving(health.handlers()) as peer:
        serving_, not_serving = ServingStatus.SERVING, ServingStatus.NOT_SERVING
        for service, expected in [
            ("", serving_),
            ("liveness", serving_),
            ("readiness", not_serving),
            (EXT_PROC_SERVICE, not_serving),
        ]:
            response = await peer.call(CHECK_PATH, check_request(service))
            assert (response.status, status_of(response)) == (0, [expected])
        health.set_ready(True)
        response = await peer.call(CHECK_PATH, check_request("readiness"))
        assert status_of(response) == [serving_]
        unknown = await peer.call(CHECK_PATH, check_request("nope"))
        assert (unknown.status, unknown.messages()) == (StatusCode.NOT_FOUND, [])
        malformed = await peer.call(CHECK_PATH, b"\xff\xff\xff")
        assert malformed.status == StatusCode.INVALID_ARGUMENT


async def test_health_watch_sends_each_change_until_cancelled() -> None:
    health = HealthService()
    async with serving(health.handlers()) as peer:
        watch = peer.client.start(WATCH_PATH)
        peer.client.send(watch, check_request("readiness"), end=True)
        unknown = peer.client.start(WATCH_PATH)
        peer.client.send(unknown, check_request("later"), end=True)
        await peer.settle()
        responses = peer.client.responses
        assert status_of(responses[watch]) == [ServingStatus.NOT_SERVING]
        assert status_of(responses[unknown]) == [ServingStatus.SERVICE_UNKNOWN]
        health.set_ready(True)
        health.set_ready(True)  # no change, no message
        health.set_status("later", ServingStatus.SERVING)
        await peer.settle()
        assert status_of(responses[watch])[1:] == [ServingStatus.SERVING]
        assert status_of(responses[unknown])[1:] == [ServingStatus.SERVING]
        assert not responses[watch].ended
        peer.client.reset(watch)
        await peer.settle()
        health.set_ready(False)
        await peer.settle()
        assert len(status_of(responses[watch])) == 2
