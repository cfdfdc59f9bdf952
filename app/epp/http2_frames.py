"""HTTP/2's vocabulary for the gRPC server (RFC 9113): frame types, flags, error codes,
settings, and the few encodings it writes. Pure.

We never index what we send (HPACK's "literal header field without indexing", no Huffman):
a header block then needs no encoder state, so the same fields are the same bytes on every
connection, and the constant ones are encoded once (`encode_headers`). Decoding what the
peer sends does need the peer's table: http2.py keeps an `hpack.Decoder` a connection.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable

from app.errors import WireError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEAD = struct.Struct(">HBBBL")  # length (24 bits, as 16 + 8), type, flags, stream
HEAD_BYTES = FRAME_HEAD.size
DEFAULT_MAX_FRAME = 16_384  # what either side may send until told otherwise
LARGEST_MAX_FRAME = (1 << 24) - 1
LARGEST_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535  # a stream's and the connection's window until widened
TABLE_SIZE_ZERO = b"\x20"  # HPACK's dynamic table size update to 0 (RFC 7541 6.3)


class FrameType(enum.IntEnum):
    DATA = 0x0
    HEADERS = 0x1
    PRIORITY = 0x2
    RST_STREAM = 0x3
    SETTINGS = 0x4
    PUSH_PROMISE = 0x5
    PING = 0x6
    GOAWAY = 0x7
    WINDOW_UPDATE = 0x8
    CONTINUATION = 0x9


class Flag:
    """Frame flags, as plain ints: an IntFlag's `&` builds a new member each time, and a
    DATA frame is tested against them on every read."""

    END_STREAM = 0x1  # DATA, HEADERS
    ACK = 0x1  # SETTINGS, PING
    END_HEADERS = 0x4
    PADDED = 0x8
    PRIORITY = 0x20


class ErrorCode(enum.IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    ENHANCE_YOUR_CALM = 0xB


class Setting(enum.IntEnum):
    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6


class ConnectionError_(WireError):
    """The peer broke the protocol for the whole connection: GOAWAY with `code`."""

    def __init__(self, code: ErrorCode, why: str) -> None:
        super().__init__(why)
        self.code = code


class StreamError(WireError):
    """The peer broke the protocol on one stream: RST_STREAM with `code`."""

    def __init__(self, code: ErrorCode, why: str) -> None:
        super().__init__(why)
        self.code = code


def frame(kind: FrameType, flags: int, stream_id: int, payload: bytes | memoryview) -> bytes:
    length = len(payload)
    return FRAME_HEAD.pack(length >> 8, length & 0xFF, kind, flags, stream_id) + payload


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(FrameType.WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def rst_stream(stream_id: int, code: ErrorCode) -> bytes:
    return frame(FrameType.RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))


def goaway(last_stream_id: int, code: ErrorCode) -> bytes:
    payload = last_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big")
    return frame(FrameType.GOAWAY, 0, 0, payload)


def settings(values: Iterable[tuple[Setting, int]]) -> bytes:
    payload = b"".join(struct.pack(">HL", key, value) for key, value in values)
    return frame(FrameType.SETTINGS, 0, 0, payload)


def unpadded(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding; padding as long as the frame is the
    connection's error (RFC 9113 6.1)."""
    if not flags & Flag.PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]


def _integer(value: int, prefix_bits: int) -> bytes:
    """HPACK's integer with an N-bit prefix (RFC 7541 5.1), the prefix's other bits 0."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_headers(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A header block of literal fields without indexing, with literal names (RFC 7541
    6.2.2): it changes no table on either side."""
    out = bytearray()
    for name, value in headers:
        out.append(0x00)
        out += _integer(len(name), 7)
        out += name
        out += _integer(len(value), 7)
        out += value
    return bytes(out)
