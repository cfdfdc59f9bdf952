"""The endpoint-picker door's gRPC protocol, read alone: no socket, no Trio, no clock.

grpc_wire.py's pieces: message framing fed whole, then byte by byte, then in odd splits (as
h11's tests/test_io.py reads bodies), the caps checked before anything is buffered, status
trailers, grpc-timeout, the request head's checks. grpc_connection.py's connection driven by
an h2 client written here (`Client`): a call's round trip; every refusal answered with its
status (unknown method, not POST, not gRPC, a message over the cap, compressed or cut
short) while the connection goes on, and none sent for a call reset in the same bytes;
garbage and a peer's GOAWAY ending the connection, random bytes (hypothesis) never raising;
flow control both ways (unread messages hold the acknowledgements back, sends stop at the
peer's window); the advertised stream cap, and streams opened before the peer saw it.
`Client` also drives the Trio server in test_epp_grpc_server.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
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
from app.epp.grpc_wire import (
    GrpcError,
    Limits,
    MessageReader,
    StatusCode,
    frame_message,
    parse_timeout,
    read_call_head,
    trailers,
)

ECHO = "/test.Echo/Chat"


# -- an h2 client: the peer of GrpcConnection here, of serve_connection in the server tests --


@dataclass
class Response:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    trailers: dict[bytes, bytes] = field(default_factory=dict)
    ended: bool = False
    reset: ErrorCodes | int | None = None

    @property
    def status(self) -> int | None:
        """grpc-status, from the trailers or a Trailers-Only answer's headers."""
        value = self.trailers.get(b"grpc-status", self.headers.get(b"grpc-status"))
        return None if value is None else int(value)

    @property
    def message(self) -> bytes:
        return self.trailers.get(b"grpc-message", self.headers.get(b"grpc-message", b""))

    def messages(self) -> list[bytes]:
        return MessageReader(1 << 30).feed(bytes(self.data))


class Client:
    """A gRPC client's HTTP/2 side, by h2: `start` calls, `send` messages, `receive` what
    the server wrote. Received DATA is acknowledged at once unless `hold_acks`."""

    def __init__(self, settings: dict[SettingCodes | int, int] | None = None) -> None:
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        if settings:
            self.h2.local_settings.update(settings)
            self.h2.local_settings.acknowledge()
        self.h2.initiate_connection()
        self.responses: dict[int, Response] = {}
        self.events: list[Event] = []
        self.hold_acks = False

    def start(
        self,
        path: str = ECHO,
        *,
        end: bool = False,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, headers or grpc_headers(path), end_stream=end)
        self.responses[stream_id] = Response()
        return stream_id

    def send(self, stream_id: int, message: bytes, *, end: bool = False) -> None:
        self.send_raw(stream_id, frame_message(message), end=end)

    def send_raw(self, stream_id: int, data: bytes, *, end: bool = False) -> None:
        self.h2.send_data(stream_id, data, end_stream=end)

    def end(self, stream_id: int) -> None:
        self.h2.end_stream(stream_id)

    def reset(self, stream_id: int) -> None:
        self.h2.reset_stream(stream_id, ErrorCodes.CANCEL)

    def data_to_send(self) -> bytes:
        return self.h2.data_to_send()

    def receive(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            self.events.append(event)
            stream_id = getattr(event, "stream_id", None)
            response = self.responses.get(stream_id) if stream_id else None
            if isinstance(event, ResponseReceived) and response is not None:
                response.headers = dict(event.headers or ())  # type: ignore[arg-type]
            elif isinstance(event, TrailersReceived) and response is not None:
                response.trailers = dict(event.headers or ())  # type: ignore[arg-type]
            elif isinstance(event, DataReceived) and response is not None:
                response.data += event.data or b""
                if not self.hold_acks and stream_id is not None:
                    self.acknowledge(stream_id, event.flow_controlled_length or 0)
            elif isinstance(event, StreamEnded) and response is not None:
                response.ended = True
            elif isinstance(event, StreamReset) and response is not None:
                response.reset = event.error_code

    def acknowledge(self, stream_id: int, size: int) -> None:
        self.h2.acknowledge_received_data(size, stream_id)


def grpc_headers(path: str = ECHO, **extra: str) -> list[tuple[bytes, bytes]]:
    headers = {
        ":method": "POST",
        ":scheme": "http",
        ":authority": "epp",
        ":path": path,
        "content-type": "application/grpc",
        "te": "trailers",
        **{name.replace("_", "-"): value for name, value in extra.items()},
    }
    return [(name.encode(), value.encode()) for name, value in headers.items()]


def exchange(client: Client, server: GrpcConnection, *, byte_by_byte: bool = False) -> list:
    """Carry bytes both ways until neither side has any: the server's events, in order."""
    events: list = []
    while True:
        out, back = client.data_to_send(), b""
        if out:
            pieces = [out[i : i + 1] for i in range(len(out))] if byte_by_byte else [out]
            for piece in pieces:
                events += server.receive_data(piece)
        back = server.data_to_send()
        if back:
            client.receive(back)
        if not out and not back:
            return events


def connected(limits: Limits | None = None) -> tuple[Client, GrpcConnection]:
    client, server = Client(), GrpcConnection({ECHO}, limits or Limits())
    assert exchange(client, server) == [WindowOpened()]  # the client's SETTINGS
    return client, server


# -- grpc_wire.py --


MESSAGES = [b"hello", b"", b"x" * 70_000, bytes(range(256))]


def test_a_message_is_a_flag_a_length_and_the_bytes() -> None:
    assert frame_message(b"abc") == b"\x00\x00\x00\x00\x03abc"
    assert frame_message(b"") == b"\x00\x00\x00\x00\x00"


@pytest.mark.parametrize("split", ["whole", "byte by byte", "random"])
def test_messages_come_out_whole_however_the_bytes_are_cut(split: str) -> None:
    data = b"".join(map(frame_message, MESSAGES))
    if split == "whole":
        pieces = [data]
    elif split == "byte by byte":
        pieces = [data[i : i + 1] for i in range(len(data))]
    else:
        rng, pieces, at = random.Random(7), [], 0
        while at < len(data):
            step = rng.randint(1, 9000)
            pieces.append(data[at : at + step])
            at += step
    reader = MessageReader()
    out: list[bytes] = []
    for piece in pieces:
        out += reader.feed(piece)
    assert out == MESSAGES
    assert reader.pending == 0
    reader.finish()


def test_a_message_over_the_cap_is_refused_from_its_prefix_alone() -> None:
    reader = MessageReader(max_message_bytes=100)
    assert reader.feed(frame_message(b"y" * 100)) == [b"y" * 100]
    prefix = b"\x00" + (101).to_bytes(4, "big")
    assert reader.feed(prefix[:4]) == []
    with pytest.raises(GrpcError) as refused:
        reader.feed(prefix[4:])
    assert refused.value.code == StatusCode.RESOURCE_EXHAUSTED
    assert reader.pending <= 5


@pytest.mark.parametrize(
    ("flag", "code"), [(1, StatusCode.UNIMPLEMENTED), (2, StatusCode.INTERNAL)]
)
def test_a_compressed_or_unknown_flag_is_refused(flag: int, code: StatusCode) -> None:
    with pytest.raises(GrpcError) as refused:
        MessageReader().feed(bytes([flag]) + b"\x00\x00\x00\x01a")
    assert refused.value.code == code


def test_a_stream_that_ends_inside_a_message_is_an_internal_error() -> None:
    reader = MessageReader()
    reader.feed(frame_message(b"abcdef")[:-2])
    with pytest.raises(GrpcError) as refused:
        reader.finish()
    assert refused.value.code == StatusCode.INTERNAL


def test_trailers_carry_the_status_and_a_percent_encoded_message() -> None:
    assert trailers(StatusCode.OK) == [(b"grpc-status", b"0")]
    assert trailers(StatusCode.INTERNAL, "100% é\n") == [
        (b"grpc-status", b"13"),
        (b"grpc-message", b"100%25 %C3%A9%0A"),
    ]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(b"5S", 5.0), (b"100m", 0.1), (b"2M", 120.0), (b"1H", 3600.0), (b"99999999n", 0.099999999)],
)
def test_grpc_timeout_is_read_in_seconds(value: bytes, seconds: float) -> None:
    assert parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [b"", b"5", b"S", b"5s", b"123456789S", b"-1S", b"1.5S"])
def test_a_malformed_grpc_timeout_is_refused(value: bytes) -> None:
    with pytest.raises(GrpcError):
        parse_timeout(value)


def test_the_request_head_names_the_method_and_its_deadline() -> None:
    head = read_call_head(grpc_headers(ECHO, grpc_timeout="250m"))
    assert (head.path, head.timeout) == (ECHO, pytest.approx(0.25))
    proto = read_call_head([*grpc_headers()[:4], (b"content-type", b"application/grpc+proto")])
    assert proto.timeout is None


@pytest.mark.parametrize(
    ("change", "code", "http_status"),
    [
        ({":method": "GET"}, StatusCode.UNIMPLEMENTED, 405),
        ({"content-type": "application/json"}, StatusCode.INTERNAL, 415),
        ({"grpc-encoding": "gzip"}, StatusCode.UNIMPLEMENTED, 200),
    ],
)
def test_a_request_that_is_not_a_plain_grpc_call_is_refused(
    change: dict[str, str], code: StatusCode, http_status: int
) -> None:
    headers = dict(grpc_headers())
    headers.update({name.encode(): value.encode() for name, value in change.items()})
    with pytest.raises(GrpcError) as refused:
        read_call_head(list(headers.items()))
    assert (refused.value.code, refused.value.http_status) == (code, http_status)


# -- grpc_connection.py, driven by the h2 client --


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
