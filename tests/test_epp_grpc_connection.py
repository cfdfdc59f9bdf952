"""The endpoint-picker door's gRPC connection (app/epp/grpc_connection.py), driven by an h2
client (tests/grpc_client.py): no socket, no Trio, no clock.

Covers: a call's round trip, whole and byte by byte; nothing to read yet being no empty
message; every refusal answered with its status (unknown method, not POST, not gRPC, a message
over the cap, compressed or cut short) while the connection goes on, and none sent for a call
reset in the same bytes; garbage and a peer's GOAWAY ending the connection, random bytes
(hypothesis) never raising; a peer's reset closing the call; flow control both ways (unread
messages hold the acknowledgements back, sends stop at the peer's window); the advertised
stream cap, and streams opened before the peer saw it.
"""

from __future__ import annotations

import pytest
from h2.errors import ErrorCodes
from h2.events import ConnectionTerminated
from h2.exceptions import TooManyStreamsError
from h2.settings import SettingCodes
from hypothesis import given, settings
from hypothesis import strategies as st

from app.epp.grpc_connection import (
    CallClosed,
    CallReadable,
    CallStarted,
    ConnectionEnded,
    GrpcConnection,
    Wait,
    WindowOpened,
)
from app.epp.grpc_wire import Limits, StatusCode, frame_message
from tests.grpc_client import ECHO, Client, connected, exchange, grpc_headers


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_a_call_goes_round_trip(byte_by_byte: bool) -> None:
    client, server = Client(), GrpcConnection({ECHO})
    stream_id = client.start()
    client.send(stream_id, b"one")
    client.send(stream_id, b"two", end=True)
    events = exchange(client, server, byte_by_byte=byte_by_byte)
    started = [event for event in events if isinstance(event, CallStarted)]
    assert [(event.stream_id, event.path) for event in started] == [(stream_id, ECHO)]
    assert (b":path", ECHO.encode()) in started[0].metadata
    assert any(isinstance(event, CallReadable) for event in events)
    assert [server.next_message(stream_id) for _ in range(3)] == [b"one", b"two", None]

    assert server.send_some(stream_id, frame_message(b"three")) == 10
    server.end_call(stream_id, StatusCode.OK)
    exchange(client, server)
    response = client.responses[stream_id]
    assert response.headers[b":status"] == b"200"
    assert response.headers[b"content-type"] == b"application/grpc"
    assert (response.messages(), response.status, response.ended) == ([b"three"], 0, True)


def test_nothing_to_read_yet_is_not_an_empty_message() -> None:
    client, server = connected()
    stream_id = client.start()
    exchange(client, server)
    assert server.next_message(stream_id) is Wait.WAIT
    client.send(stream_id, b"")
    exchange(client, server)
    assert server.next_message(stream_id) == b""


def test_an_unknown_method_is_unimplemented_and_the_connection_goes_on() -> None:
    client, server = connected()
    unknown = client.start("/no.Such/Method")
    client.send(unknown, b"x")  # not ended: the server also tells it to stop sending
    assert not [e for e in exchange(client, server) if isinstance(e, CallStarted)]
    response = client.responses[unknown]
    assert (response.status, response.headers[b":status"]) == (StatusCode.UNIMPLEMENTED, b"200")
    assert response.reset == ErrorCodes.NO_ERROR
    known = client.start(end=True)
    assert any(isinstance(e, CallStarted) for e in exchange(client, server))
    server.end_call(known, StatusCode.OK)
    exchange(client, server)
    assert client.responses[known].status == 0


@pytest.mark.parametrize(
    ("headers", "http_status"),
    [
        ([(b":method", b"GET"), *grpc_headers()[1:]], b"405"),
        ([*grpc_headers()[:4], (b"content-type", b"text/plain")], b"415"),
    ],
)
def test_what_is_not_grpc_gets_an_http_status(
    headers: list[tuple[bytes, bytes]], http_status: bytes
) -> None:
    client, server = connected()
    stream_id = client.start(headers=headers, end=True)
    assert exchange(client, server) == []
    assert client.responses[stream_id].headers[b":status"] == http_status


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"\x00" + (4097).to_bytes(4, "big") + b"z" * 10, StatusCode.RESOURCE_EXHAUSTED),
        (b"\x01\x00\x00\x00\x01z", StatusCode.UNIMPLEMENTED),
    ],
)
def test_bad_framing_ends_that_call_only(data: bytes, code: StatusCode) -> None:
    client, server = connected(Limits(max_message_bytes=4096))
    bad, good = client.start(), client.start()
    exchange(client, server)
    client.send_raw(bad, data)
    client.send(good, b"fine")
    events = exchange(client, server)
    assert CallClosed(bad) in events
    assert client.responses[bad].status == code
    assert server.next_message(good) == b"fine"
    assert server.is_open(good) and not server.is_open(bad)


@pytest.mark.parametrize("refusal", ["unknown method", "oversize"])
def test_a_refusal_for_a_call_reset_in_the_same_bytes_is_not_sent(refusal: str) -> None:
    client, server = connected(Limits(max_message_bytes=10))
    stream_id = client.start("/no.Such/Method" if refusal == "unknown method" else ECHO)
    client.send(stream_id, b"x" * 20)
    client.reset(stream_id)
    events = exchange(client, server)  # h2 has read the reset before we answer the call
    started = [e for e in events if isinstance(e, CallStarted)]
    assert (len(started), CallClosed(stream_id) in events) == (
        (0, False) if refusal == "unknown method" else (1, True)
    )
    assert client.responses[stream_id].status is None
    assert not any(isinstance(e, ConnectionTerminated) for e in client.events)
    assert not server.ended


def test_a_request_cut_inside_a_message_is_an_internal_error() -> None:
    client, server = connected()
    stream_id = client.start()
    client.send_raw(stream_id, frame_message(b"abcdef")[:-1], end=True)
    assert CallClosed(stream_id) in exchange(client, server)
    assert client.responses[stream_id].status == StatusCode.INTERNAL


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",
        bytes(range(256)) * 4,
        b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n",
    ],
)
def test_garbage_ends_the_connection_with_goaway(garbage: bytes) -> None:
    server = GrpcConnection({ECHO})
    server.data_to_send()
    assert server.receive_data(garbage) == [ConnectionEnded(error=True)]
    assert server.ended and server.receive_data(b"more") == []
    goaway = server.data_to_send()
    assert goaway[3] == 0x7  # a GOAWAY frame


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8), st.booleans())
def test_no_bytes_make_the_connection_raise(chunks: list[bytes], after_a_call: bool) -> None:
    client = Client()
    if after_a_call:
        client.send(client.start(), b"ok")
    server = GrpcConnection({ECHO})
    events = server.receive_data(client.data_to_send())
    for chunk in chunks:
        events += server.receive_data(chunk)
    server.data_to_send()
    assert all(not isinstance(e, ConnectionEnded) or e.error for e in events)


def test_a_peer_goaway_ends_the_connection() -> None:
    client, server = connected()
    client.h2.close_connection()
    assert exchange(client, server) == [ConnectionEnded(error=False)]


def test_a_peer_reset_closes_the_call() -> None:
    client, server = connected()
    stream_id = client.start()
    exchange(client, server)
    client.reset(stream_id)
    assert exchange(client, server) == [CallClosed(stream_id)]
    assert server.send_some(stream_id, b"late") == 0
    server.end_call(stream_id, StatusCode.OK)  # nothing to end: no frame, no error
    assert server.data_to_send() == b""


def test_unread_messages_hold_back_the_acknowledgements() -> None:
    limits = Limits(stream_window=4096, connection_window=1 << 20, max_unread_bytes=1024)
    client, server = connected(limits)
    stream_id = client.start()
    exchange(client, server)
    sent = 0
    while client.h2.local_flow_control_window(stream_id) >= 505:
        client.send(stream_id, b"m" * 500)
        exchange(client, server)
        sent += 1
    # Everything the window allowed arrived, and nothing was acknowledged past the limit.
    assert sent == 4096 // 505
    assert client.h2.local_flow_control_window(stream_id) < 505
    for _ in range(sent):
        assert server.next_message(stream_id) == b"m" * 500
    exchange(client, server)
    assert client.h2.local_flow_control_window(stream_id) >= 2048


def test_sends_stop_at_the_peer_window_and_resume_when_it_opens() -> None:
    client = Client({SettingCodes.INITIAL_WINDOW_SIZE: 100})
    server = GrpcConnection({ECHO})
    exchange(client, server)
    client.hold_acks = True
    stream_id = client.start()
    exchange(client, server)
    data = frame_message(b"w" * 250)
    assert server.send_some(stream_id, data) == 100
    assert server.send_some(stream_id, data[100:]) == 0
    exchange(client, server)
    client.acknowledge(stream_id, 100)
    client.h2.increment_flow_control_window(200, stream_id=stream_id)
    assert WindowOpened() in exchange(client, server)
    assert server.send_some(stream_id, data[100:]) == 155


def test_the_stream_cap_is_advertised_and_early_streams_are_let_in() -> None:
    limits = Limits(max_concurrent_streams=2, stream_window=300_000, connection_window=3 << 20)
    client, server = Client(), GrpcConnection({ECHO}, limits)
    # Three calls opened before the server's SETTINGS arrive: not a protocol error.
    early = [client.start() for _ in range(3)]
    events = exchange(client, server)
    assert [e.stream_id for e in events if isinstance(e, CallStarted)] == early
    remote = client.h2.remote_settings
    assert remote.max_concurrent_streams == 2
    assert remote.initial_window_size == 300_000
    assert client.h2.outbound_flow_control_window == 3 << 20
    with pytest.raises(TooManyStreamsError):
        client.start()
    assert not any(isinstance(e, ConnectionTerminated) for e in client.events)


def test_acknowledgements_come_in_batches_and_a_call_gives_back_what_it_held() -> None:
    # A batch of 8,191 bytes a call; the connection's window (65,535) is not widened.
    limits = Limits(stream_window=65_535, connection_window=65_535, max_concurrent_streams=4)
    assert limits.ack_batch == 8_191
    client, server = connected(limits)
    # 20 calls of 4,000 bytes each, all read and ended: more than the connection's window,
    # crossing only because each ended call gives its unacknowledged bytes back.
    for _ in range(20):
        stream_id = client.start()
        client.send(stream_id, b"c" * 4_000)
        exchange(client, server)
        assert server.next_message(stream_id) == b"c" * 4_000
        server.end_call(stream_id, StatusCode.OK)
        exchange(client, server)
    assert client.h2.outbound_flow_control_window >= 65_535 // 2
