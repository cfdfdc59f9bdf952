"""The endpoint-picker door's gRPC wire format (app/epp/grpc_wire.py), read alone: no socket, no
Trio, no clock.

Covers: message framing fed whole, then byte by byte, then in odd splits (as h11's
tests/test_io.py reads bodies), the caps checked before anything is buffered, compressed or
unknown flags, a stream ending inside a message; status trailers with a percent-encoded
message; grpc-timeout read in seconds, and refused when malformed; the request head's checks
(the method and its deadline named, what is not a plain gRPC call refused).
"""

from __future__ import annotations

import random

import pytest

from app.epp.grpc_wire import (
    GrpcError,
    MessageReader,
    StatusCode,
    frame_message,
    parse_timeout,
    read_call_head,
    trailers,
)
from tests.grpc_client import ECHO, grpc_headers

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
