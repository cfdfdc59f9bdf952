"""HTTP/1.1 message bodies, decoded as their bytes arrive (RFC 9112 §6-7). Pure: no I/O.

The relay reads a backend's body straight off the socket and hands the client whatever has
arrived in one write, so it decodes framing itself instead of asking h11 for one event per
chunk: a streamed answer is one chunk per token, and h11's per-event state machine was a
third of the relay's CPU. One `feed` per socket read returns the body bytes that read
completed, however many chunks it held; framing split across reads (a size line, the CRLF
after a chunk) is held back until the rest arrives, never more than `MAX_LINE_BYTES`.

Three framings, chosen from the response head as h11 chooses them (`decoder_for`):
`Content-Length`, `Transfer-Encoding: chunked`, and a body that ends when the connection
closes. Violations raise `FramingError`, which the relay reports as a broken backend.
`chunk` is the other direction: one chunk of the client's chunked response.
"""

from __future__ import annotations

import re
from typing import Protocol

from app.errors import WireError

# A chunk-size line (size and extensions) or a trailer line longer than this is refused,
# as is a trailer section longer than MAX_TRAILER_BYTES: held-back framing stays bounded.
MAX_LINE_BYTES = 4096
MAX_TRAILER_BYTES = 16384
# Like h11: hex digits, then extensions that are ignored; whitespace allowed before them.
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;.*)?")

LAST_CHUNK = b"0\r\n\r\n"
MAX_LENGTH_DIGITS = 18


class FramingError(WireError, ValueError):
    """The body does not follow its declared framing."""


class UnsupportedCoding(FramingError):
    """A transfer coding other than chunked (RFC 9112 §6.1: 501 for a request)."""


class BodyDecoder(Protocol):
    """Turns a body's bytes on the wire into its content, read by read."""

    done: bool  # the whole body has arrived
    leftover: bytes  # bytes that came after the body (a well-behaved peer sends none)

    def feed(self, data: bytes) -> list[bytes]:
        """The content that `data` completes; [] when it held only framing."""
        ...

    def end_of_input(self) -> None:
        """The peer closed the connection: raise FramingError unless the body is complete."""
        ...


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked body (it must not be empty: that ends the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def decoder_for(status: int, headers: list[tuple[bytes, bytes]], method: bytes) -> BodyDecoder:
    """The decoder for a response to `method` with this status and (lower-case) headers."""
    if method == b"HEAD" or status in (204, 304) or 100 <= status < 200:
        return LengthDecoder(0)
    return _declared_decoder(headers) or CloseDelimitedDecoder()


def request_decoder(headers: list[tuple[bytes, bytes]]) -> BodyDecoder:
    """The decoder for a request body with these (lower-case) headers: one without
    Content-Length or Transfer-Encoding is empty (RFC 9112 §6.3)."""
    return _declared_decoder(headers) or LengthDecoder(0)


def _declared_decoder(headers: list[tuple[bytes, bytes]]) -> BodyDecoder | None:
    transfer_coding = None
    length = None
    for name, value in headers:
        if name == b"transfer-encoding":
            if transfer_coding is not None:
                raise FramingError("more than one Transfer-Encoding header")
            transfer_coding = value.strip().lower()
        elif name == b"content-length":
            # Repeated or listed lengths must agree (RFC 9112 §6.3), or the body's end, and
            # so the next message's start on a kept-alive connection, is ambiguous.
            for listed in value.split(b","):
                if length is not None and listed.strip() != length:
                    raise FramingError("conflicting Content-Length values")
                length = listed.strip()
    if transfer_coding is not None:
        if transfer_coding != b"chunked":
            raise UnsupportedCoding(f"unsupported transfer coding {transfer_coding!r}")
        return ChunkedDecoder()
    if length is not None:
        # More digits than any body this side of an exabyte: refused before int() parses it.
        if not length.isdigit() or len(length) > MAX_LENGTH_DIGITS:
            raise FramingError(f"invalid Content-Length {length[:40]!r}")
        return LengthDecoder(int(length))
    return None


class LengthDecoder:
    __slots__ = ("_remaining", "done", "leftover")

    def __init__(self, length: int) -> None:
        self._remaining = length
        self.done = length == 0
        self.leftover = b""

    def feed(self, data: bytes) -> list[bytes]:
        if self.done:
            self.leftover += data
            return []
        remaining = self._remaining
        if len(data) < remaining:
            self._remaining = remaining - len(data)
            return [data] if data else []
        self._remaining = 0
        self.done = True
        self.leftover = data[remaining:]
        return [data[:remaining]] if remaining else []

    def end_of_input(self) -> None:
        if not self.done:
            raise FramingError(f"the body ended {self._remaining} bytes short of its length")


class CloseDelimitedDecoder:
    """HTTP/1.0 style: everything until the peer closes."""

    __slots__ = ("done", "leftover")

    def __init__(self) -> None:
        self.done = False
        self.leftover = b""

    def feed(self, data: bytes) -> list[bytes]:
        return [data] if data else []

    def end_of_input(self) -> None:
        self.done = True


# ChunkedDecoder's states.
_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)


class ChunkedDecoder:
    __slots__ = ("_held", "_remaining", "_state", "_trailer_bytes", "done", "leftover")

    def __init__(self) -> None:
        self._state = _SIZE
        self._remaining = 0  # bytes of the current chunk still to come
        self._held = b""  # incomplete framing from the previous read
        self._trailer_bytes = 0
        self.done = False
        self.leftover = b""

    def feed(self, data: bytes) -> list[bytes]:
        if self._state == _DONE:
            self.leftover += data
            return []
        buffer = self._held + data if self._held else data
        self._held = b""
        size = len(buffer)
        pieces: list[bytes] = []
        position = 0
        state = self._state
        while position < size:
            if state == _DATA:
                end = position + self._remaining
                if end > size:
                    pieces.append(buffer[position:])
                    self._remaining = end - size
                    position = size
                    break
                pieces.append(buffer[position:end])
                self._remaining = 0
                position = end
                state = _DATA_END
            elif state == _DATA_END:
                if size - position < 2:
                    if buffer[position:] != b"\r":
                        raise FramingError("a chunk is not followed by CRLF")
                    break
                if buffer[position : position + 2] != b"\r\n":
                    raise FramingError("a chunk is not followed by CRLF")
                position += 2
                state = _SIZE
            else:
                end = buffer.find(b"\r\n", position)
                if end < 0:
                    if size - position > MAX_LINE_BYTES:
                        raise FramingError("a chunk-size or trailer line is too long")
                    break
                line = buffer[position:end]
                position = end + 2
                if state == _SIZE:
                    match = _CHUNK_SIZE.fullmatch(line)
                    if match is None:
                        raise FramingError(f"invalid chunk-size line {line[:40]!r}")
                    self._remaining = int(match.group(1), 16)
                    state = _DATA if self._remaining else _TRAILER
                elif line:
                    self._trailer_bytes += len(line) + 2
                    if self._trailer_bytes > MAX_TRAILER_BYTES:
                        raise FramingError("the trailer section is too long")
                else:
                    state = _DONE
                    self.done = True
                    self.leftover = buffer[position:]
                    position = size
        self._state = state
        if position < size:
            self._held = buffer[position:]
        return pieces

    def end_of_input(self) -> None:
        if not self.done:
            raise FramingError("the connection closed before the last chunk")
