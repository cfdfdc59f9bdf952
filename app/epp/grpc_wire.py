"""gRPC over HTTP/2, the parts above the frames: message framing, status codes, headers.

Pure functions and one small parser, no I/O and no HTTP/2 state (grpc_connection.py holds
that), so each rule here is tested by feeding bytes. The wire format is gRPC's
PROTOCOL-HTTP2.md: every message is a 5-byte prefix (a compressed flag, then the length as
a big-endian uint32) and the protobuf bytes; the status travels in trailers (`grpc-status`,
`grpc-message` percent-encoded), or in the response headers alone when no message was sent
("Trailers-Only").

Compression is never negotiated: we advertise `grpc-accept-encoding: identity` and refuse a
compressed message, since Envoy's ext_proc client does not compress and inflating a peer's
bytes would be one more thing to bound.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from app.errors import WireError

PREFIX_BYTES = 5
# gRPC's own default receive cap; the server's limits may raise it.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one connection may make the server hold (grpc_connection.py says how)."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Envoy opens a stream per proxied request, kept for its whole answer, and opens another
    # connection when one is full: this caps calls per connection, not in all.
    max_concurrent_streams: int = 1000
    # Wide enough that a large prompt body crosses in a few round trips.
    stream_window: int = 1 << 20
    connection_window: int = 16 << 20
    # Complete messages a call may hold unread before we stop acknowledging its bytes.
    max_unread_bytes: int = 256 * 1024
    max_header_list_bytes: int = 64 * 1024

    @property
    def ack_batch(self) -> int:
        """Bytes a call acknowledges at a time. h2 sends a WINDOW_UPDATE only once half a
        window is consumed anyway, and an h2 call per message cost ~3% of the picker's CPU;
        small enough that all calls' held bytes together stay under half the connection's
        window and an eighth of their own."""
        per_call = self.connection_window // (2 * self.max_concurrent_streams)
        return max(1, min(self.stream_window // 8, per_call))


DEFAULT_LIMITS = Limits()


class StatusCode(enum.IntEnum):
    """The gRPC status codes (grpc/doc/statuscodes.md)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class GrpcError(WireError):
    """Ends one call with `code` and `message` in its trailers; a handler raises it."""

    def __init__(self, code: StatusCode, message: str = "", *, http_status: int = 200) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        # Not 200 only for a request that is not a gRPC call at all.
        self.http_status = http_status


def frame_message(message: bytes) -> bytes:
    """One length-prefixed message, uncompressed."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


class MessageReader:
    """Length-prefixed messages out of a call's DATA bytes, however they are split.

    Holds at most one incomplete message, and refuses one whose declared length is over
    `max_message_bytes` as soon as its prefix arrives, before buffering any of it.
    """

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._buffer = bytearray()
        self._needed = 0  # length of the message being collected, 0 while reading a prefix

    @property
    def pending(self) -> int:
        """Bytes held of a message (or prefix) not yet whole."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        """Every message `data` completes, in order. Raises GrpcError on a bad prefix."""
        messages: list[bytes] = []
        if not self._buffer:
            # The usual case: DATA frames that hold whole messages, sliced without copying
            # them through the buffer.
            start, end = 0, len(data)
            while end - start >= PREFIX_BYTES:
                length = self._check_prefix(data[start : start + PREFIX_BYTES])
                if end - start - PREFIX_BYTES < length:
                    break
                begin = start + PREFIX_BYTES
                messages.append(bytes(data[begin : begin + length]))
                start = begin + length
            if start == end:
                return messages
            data = data[start:]
        self._buffer += data
        while True:
            if not self._needed:
                if len(self._buffer) < PREFIX_BYTES:
                    return messages
                self._needed = PREFIX_BYTES + self._check_prefix(self._buffer[:PREFIX_BYTES])
            if len(self._buffer) < self._needed:
                return messages
            messages.append(bytes(self._buffer[PREFIX_BYTES : self._needed]))
            del self._buffer[: self._needed]
            self._needed = 0

    def finish(self) -> None:
        """The peer ended its side: raises GrpcError if a message was left unfinished."""
        if self._buffer:
            raise GrpcError(StatusCode.INTERNAL, "stream ended inside a message")

    def _check_prefix(self, prefix: bytes | bytearray) -> int:
        flag, length = prefix[0], int.from_bytes(prefix[1:PREFIX_BYTES], "big")
        if flag == 1:
            raise GrpcError(StatusCode.UNIMPLEMENTED, "compressed messages are not accepted")
        if flag != 0:
            raise GrpcError(StatusCode.INTERNAL, f"bad message flag {flag}")
        if length > self.max_message_bytes:
            raise GrpcError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"message of {length} bytes is over the limit of {self.max_message_bytes}",
            )
        return length


Headers = list[tuple[bytes, bytes]]

RESPONSE_HEADERS: Headers = [
    (b":status", b"200"),
    (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", b"identity"),
]


def _percent_encode(message: str) -> bytes:
    """grpc-message's encoding: printable ASCII but '%' as is, every other byte as %XX."""
    return b"".join(
        bytes((byte,)) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte
        for byte in message.encode("utf-8")
    )


def trailers(code: StatusCode, message: str = "") -> Headers:
    """The trailers that end a call whose response headers were already sent."""
    fields = [(b"grpc-status", b"%d" % code)]
    if message:
        fields.append((b"grpc-message", _percent_encode(message)))
    return fields


def trailers_only(code: StatusCode, message: str = "", http_status: int = 200) -> Headers:
    """The single HEADERS frame of a call answered with no message at all."""
    return [
        (b":status", b"%d" % http_status),
        (b"content-type", b"application/grpc"),
        *trailers(code, message),
    ]


_TIMEOUT = re.compile(rb"([0-9]{1,8})([HMSmun])")
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(value: bytes) -> float:
    """`grpc-timeout` in seconds (at most 8 digits and a unit). Raises GrpcError if malformed."""
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        raise GrpcError(StatusCode.INVALID_ARGUMENT, "malformed grpc-timeout")
    return int(match[1]) * _TIMEOUT_UNITS[match[2]]


class CallHead:
    """What a request's headers say about the call, checked."""

    __slots__ = ("path", "timeout")

    def __init__(self, path: str, timeout: float | None) -> None:
        self.path = path
        self.timeout = timeout


def read_call_head(headers: Headers) -> CallHead:
    """The path and deadline of a call. Raises GrpcError, with an HTTP status for requests
    that are not gRPC at all (405 for a method other than POST, 415 for another
    content-type, as PROTOCOL-HTTP2.md says)."""
    method = path = content_type = encoding = timeout = b""
    for name, value in headers:
        if name == b":method":
            method = value
        elif name == b":path":
            path = value
        elif name == b"content-type":
            content_type = value
        elif name == b"grpc-encoding":
            encoding = value
        elif name == b"grpc-timeout":
            timeout = value
    if method != b"POST":
        raise GrpcError(StatusCode.UNIMPLEMENTED, "gRPC calls are POST requests", http_status=405)
    if not (content_type == b"application/grpc" or content_type.startswith(b"application/grpc+")):
        raise GrpcError(
            StatusCode.INTERNAL, "content-type is not application/grpc", http_status=415
        )
    if encoding not in (b"", b"identity"):
        raise GrpcError(StatusCode.UNIMPLEMENTED, "only the identity grpc-encoding is accepted")
    return CallHead(path.decode("ascii", "replace"), parse_timeout(timeout) if timeout else None)
