"""The gRPC server's HTTP/2 connection (app/epp/http2.py) read alone: no socket, no Trio.

Its peer is an h2 client, which checks every frame we write, or frames made by hand for
what a well-behaved client never sends. Covered: a request's headers, data and end, fed
whole and byte by byte; PING and SETTINGS answered; the peer's window and frame size
obeyed when sending, our windows given back in halves; every protocol error of the peer's
ending the connection with GOAWAY and its code (a stream's error only that stream);
header blocks of a reset stream still decoded (HPACK stays in step); the stream cap
enforced once acknowledged; random bytes never raising.
"""

from __future__ import annotations

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived as ClientData
from h2.events import (
    PingAckReceived,
    ResponseReceived,
    SettingsAcknowledged,
    TrailersReceived,
)
from h2.settings import SettingCodes
from hypothesis import given, settings
from hypothesis import strategies as st

from app.epp.http2 import (
    ConnectionTerminated,
    DataReceived,
    LocalSettings,
    RequestReceived,
    ServerConnection,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from app.epp.http2_frames import (
    PREFACE,
    ErrorCode,
    Flag,
    FrameType,
    encode_headers,
    frame,
)
from app.epp.http2_frames import settings as settings_frame

LOCAL = LocalSettings(
    max_concurrent_streams=2, stream_window=4096, connection_window=1 << 20,
    max_header_list_bytes=4096,
)  # fmt: skip
REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/a.B/C"),
           (b":authority", b"epp"), (b"content-type", b"application/grpc")]  # fmt: skip


def client(**settings: int) -> H2Connection:
    peer = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    if settings:
        peer.local_settings.update({getattr(SettingCodes, k): v for k, v in settings.items()})
        peer.local_settings.acknowledge()
    peer.initiate_connection()
    return peer


def carry(peer: H2Connection, server: ServerConnection, *, byte_by_byte: bool = False) -> list:
    """Bytes both ways until neither side has any: the server's events, in order."""
    events: list = []
    while True:
        out = peer.data_to_send()
        for piece in [out[i : i + 1] for i in range(len(out))] if byte_by_byte else [out]:
            events += server.receive_data(piece)
        back = server.data_to_send()
        if back:
            peer.receive_data(back)
        if not out and not back:
            return events


def opened() -> tuple[H2Connection, ServerConnection]:
    peer, server = client(), ServerConnection(LOCAL)
    carry(peer, server)
    return peer, server


def raw_server() -> ServerConnection:
    """A server that has read a client's preface and empty SETTINGS, answered nothing yet."""
    server = ServerConnection(LOCAL)
    assert server.receive_data(PREFACE + settings_frame([])) == [WindowUpdated()]
    server.data_to_send()
    return server


def goaway_code(data: bytes) -> int | None:
    """The error code of the GOAWAY frame in `data`, if there is one."""
    at = 0
    while at + 9 <= len(data):
        length = int.from_bytes(data[at : at + 3], "big")
        if data[at + 3] == FrameType.GOAWAY:
            return int.from_bytes(data[at + 13 : at + 17], "big")
        at += 9 + length
    return None


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_a_request_arrives_as_headers_data_and_its_end(byte_by_byte: bool) -> None:
    peer, server = client(), ServerConnection(LOCAL)
    carry(peer, server)
    peer.send_headers(1, REQUEST)
    peer.send_data(1, b"x" * 100, end_stream=True)
    events = carry(peer, server, byte_by_byte=byte_by_byte)
    data = b"".join(e.data for e in events if isinstance(e, DataReceived))
    assert events[0] == RequestReceived(1, REQUEST)
    assert data == b"x" * 100
    assert events[-1] == StreamEnded(1)


def test_an_answer_reaches_the_client_whole() -> None:
    peer, server = opened()
    peer.send_headers(1, REQUEST, end_stream=True)
    carry(peer, server)
    server.send_headers(1, encode_headers([(b":status", b"200")]))
    assert server.send_data(1, b"answer") == 6
    server.send_headers(1, encode_headers([(b"grpc-status", b"0")]), end_stream=True)
    got = peer.receive_data(server.data_to_send())
    assert [type(e) for e in got[:3]] == [ResponseReceived, ClientData, TrailersReceived]
    assert not server.may_send(1)


def test_sends_stop_at_the_peer_window_and_frames_keep_its_size() -> None:
    peer, server = client(INITIAL_WINDOW_SIZE=100), ServerConnection(LOCAL)
    carry(peer, server)
    peer.send_headers(1, REQUEST)
    carry(peer, server)
    server.send_headers(1, encode_headers([(b":status", b"200")]))
    assert server.send_data(1, b"y" * 150) == 100
    assert server.window(1) == 0
    peer.receive_data(server.data_to_send())
    peer.increment_flow_control_window(50, stream_id=1)
    assert WindowUpdated() in carry(peer, server)
    assert server.send_data(1, b"y" * 50) == 50


def test_a_new_header_table_size_is_answered_with_a_size_update() -> None:
    peer = client(HEADER_TABLE_SIZE=256)
    server = ServerConnection(LOCAL)
    carry(peer, server)
    peer.send_headers(1, REQUEST)
    carry(peer, server)
    server.send_headers(1, encode_headers([(b":status", b"200")]))
    out = server.data_to_send()
    assert out[9:10] == b"\x20"  # the block opens with the update
    (response,) = peer.receive_data(out)
    assert dict(response.headers)[b":status"] == b"200"


def test_a_long_header_block_is_cut_into_continuations() -> None:
    peer, server = opened()
    peer.send_headers(1, REQUEST)
    carry(peer, server)
    long_value = b"v" * 40_000
    server.send_headers(1, encode_headers([(b":status", b"200"), (b"x-long", long_value)]))
    (response,) = peer.receive_data(server.data_to_send())
    assert dict(response.headers)[b"x-long"] == long_value


def test_taken_bytes_are_given_back_in_halves_of_a_window() -> None:
    peer, server = opened()
    peer.send_headers(1, REQUEST)
    peer.send_data(1, b"z" * 4000)
    carry(peer, server)
    assert peer.local_flow_control_window(1) == 96
    server.acknowledge(1000, 1)
    carry(peer, server)
    assert peer.local_flow_control_window(1) == 96  # less than half the window is owed
    server.acknowledge(1500, 1)
    carry(peer, server)
    assert peer.local_flow_control_window(1) == 2596


def test_ping_and_settings_are_answered_and_the_frame_size_obeyed() -> None:
    peer, server = opened()
    peer.ping(b"12345678")
    peer.update_settings({SettingCodes.MAX_FRAME_SIZE: 20_000})
    peer.send_headers(1, REQUEST)
    server.receive_data(peer.data_to_send())
    got = peer.receive_data(server.data_to_send())
    assert {PingAckReceived, SettingsAcknowledged} <= {type(e) for e in got}
    server.send_headers(1, encode_headers([(b":status", b"200")]))
    server.send_data(1, b"q" * 20_000)
    got = peer.receive_data(server.data_to_send())
    assert [len(e.data) for e in got if isinstance(e, ClientData)] == [20_000]


def test_a_reset_streams_trailers_are_still_decoded() -> None:
    peer, server = opened()
    peer.send_headers(1, REQUEST)
    carry(peer, server)
    server.reset(1, ErrorCode.NO_ERROR)
    # Trailers sent before the client saw the reset: they add to its HPACK table...
    peer.send_headers(1, [(b"x-trailer", b"kept in the table")], end_stream=True)
    assert server.receive_data(peer.data_to_send()) == []
    peer.receive_data(server.data_to_send())
    # ... which its next request's headers refer to.
    peer.send_headers(3, [*REQUEST, (b"x-trailer", b"kept in the table")])
    (started,) = carry(peer, server)
    assert started == RequestReceived(3, [*REQUEST, (b"x-trailer", b"kept in the table")])


def test_the_stream_cap_holds_once_our_settings_are_acknowledged() -> None:
    server = raw_server()
    opening = [frame(FrameType.HEADERS, Flag.END_HEADERS, n, encode_headers(REQUEST))
               for n in (1, 3, 5, 7)]  # fmt: skip
    # Before the client has seen the cap (2), its streams are let in.
    events = server.receive_data(b"".join(opening[:3]))
    assert [e.stream_id for e in events] == [1, 3, 5]
    assert server.receive_data(frame(FrameType.SETTINGS, Flag.ACK, 0, b"") + opening[3]) == []
    reset = server.data_to_send()
    assert reset == frame(FrameType.RST_STREAM, 0, 7, ErrorCode.REFUSED_STREAM.to_bytes(4, "big"))


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        (frame(FrameType.DATA, 0, 1, b"x"), ErrorCode.PROTOCOL_ERROR),  # an idle stream
        (frame(FrameType.HEADERS, Flag.END_HEADERS, 2, b""), ErrorCode.PROTOCOL_ERROR),
        (frame(FrameType.PUSH_PROMISE, 0, 1, b"\0" * 4), ErrorCode.PROTOCOL_ERROR),
        (frame(FrameType.PING, 0, 0, b"short"), ErrorCode.PROTOCOL_ERROR),
        (frame(FrameType.SETTINGS, 0, 0, b"\0" * 5), ErrorCode.FRAME_SIZE_ERROR),
        (frame(FrameType.WINDOW_UPDATE, 0, 0, b"\0" * 4), ErrorCode.FLOW_CONTROL_ERROR),
        (frame(FrameType.DATA, 0, 0, b"\0" * 16_385), ErrorCode.FRAME_SIZE_ERROR),
        (frame(FrameType.HEADERS, 0, 1, encode_headers(REQUEST))
         + frame(FrameType.PING, 0, 0, b"\0" * 8), ErrorCode.PROTOCOL_ERROR),
        (frame(FrameType.HEADERS, Flag.END_HEADERS, 1, b"\xff\xff"), ErrorCode.COMPRESSION_ERROR),
    ],
)  # fmt: skip
def test_a_peer_error_ends_the_connection_with_its_code(frames: bytes, code: ErrorCode) -> None:
    server = raw_server()
    events = server.receive_data(frames)
    assert events[-1] == ConnectionTerminated(error=True)
    assert goaway_code(server.data_to_send()) == code
    assert server.receive_data(frames) == []  # nothing is read after it


def test_data_past_a_streams_window_resets_that_stream_only() -> None:
    server = raw_server()
    opening = frame(FrameType.HEADERS, Flag.END_HEADERS, 1, encode_headers(REQUEST))
    events = server.receive_data(opening + frame(FrameType.DATA, 0, 1, b"\0" * 4097))
    assert events == [RequestReceived(1, REQUEST), StreamReset(1)]
    code = ErrorCode.FLOW_CONTROL_ERROR.to_bytes(4, "big")
    assert server.data_to_send().endswith(frame(FrameType.RST_STREAM, 0, 1, code))
    assert not server.closed


def test_a_frame_other_than_settings_first_or_a_wrong_preface_is_refused() -> None:
    assert ServerConnection(LOCAL).receive_data(b"GET / HTTP/1.1\r\n")[-1].error
    server = ServerConnection(LOCAL)
    assert server.receive_data(PREFACE + frame(FrameType.PING, 0, 0, b"\0" * 8))[-1].error


def test_a_peer_goaway_ends_the_connection_quietly() -> None:
    peer, server = opened()
    peer.close_connection()
    assert carry(peer, server) == [ConnectionTerminated(error=False)]
    assert server.closed


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_no_bytes_make_the_connection_raise(chunks: list[bytes]) -> None:
    server = raw_server()
    for chunk in chunks:
        server.receive_data(chunk)
        server.data_to_send()
