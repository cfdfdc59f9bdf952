"""The cost of a request head trickling in (app/http/request_head.py), counted in bytes searched
rather than timed: a 16,000-byte head or target fed one byte per read finishes, and a head
arriving one byte at a time is searched about as often as one arriving whole.
"""

from __future__ import annotations

from typing import Any

from app.http.request_head import HeadReader
from tests.request_heads import MAX_HEAD_BYTES, parse_bytewise, parse_whole


def test_a_16000_byte_head_fed_one_byte_at_a_time_finishes() -> None:
    fields = b"".join(b"X-Field-%04d: %s\r\n" % (n, b"v" * 20) for n in range(400))
    head = b"GET / HTTP/1.1\r\nHost: h\r\n" + fields
    head += b"X-Pad: " + b"p" * (16_000 - len(head) - 11) + b"\r\n\r\n"
    assert len(head) == 16_000
    parsed, rest = parse_bytewise(head + b"body")
    assert rest == b"body" and len(parsed.headers) == 402
    assert parse_whole(head + b"body") == (parsed, rest)


def test_a_16000_byte_target_fed_one_byte_at_a_time_finishes() -> None:
    frame = b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"
    head = b"GET /" + b"t" * (16_000 - len(frame)) + frame[5:]
    assert len(head) == 16_000
    parsed, _ = parse_bytewise(head)
    assert parsed.target == b"/" + b"t" * (16_000 - len(frame))


class CountingBytes(bytes):
    """Bytes that count how many bytes the reader's searches are asked to scan: deterministic,
    unlike a timing, and in the same unit whichever machine runs it."""

    scanned = 0

    def find(self, sub: Any, start: Any = None, end: Any = None) -> int:
        begin = 0 if start is None else start
        CountingBytes.scanned += len(self) - min(begin, len(self))
        return super().find(sub, start, end)

    def __contains__(self, sub: Any) -> bool:
        CountingBytes.scanned += len(self)
        return super().__contains__(sub)

    def split(self, sep: Any = None, maxsplit: Any = -1) -> list[bytes]:
        CountingBytes.scanned += len(self)
        return super().split(sep, maxsplit)


def bytes_searched(data: bytes, step: int) -> int:
    """The bytes searched reading the head `data` starts with, `step` bytes per read."""
    CountingBytes.scanned = 0
    reader = HeadReader(MAX_HEAD_BYTES)
    unread = b""
    for start in range(0, len(data), step):
        unread += data[start : start + step]
        head, taken = reader.parse(CountingBytes(unread))
        unread = unread[taken:]
        if head is not None:
            return CountingBytes.scanned
    raise AssertionError("the head never ended")


def test_a_head_trickling_in_is_searched_about_once() -> None:
    """Module docstring: 'each byte is searched once however the head arrives'."""
    fields = b"".join(b"X-Field-%04d: %s\r\n" % (n, b"v" * 20) for n in range(400))
    head = b"GET / HTTP/1.1\r\nHost: h\r\n" + fields + b"\r\n"
    whole = bytes_searched(head, len(head))
    assert whole <= 3 * len(head)
    assert bytes_searched(head, 1) <= 4 * whole


def test_a_long_request_line_trickling_in_is_searched_about_once() -> None:
    head = b"GET /" + b"t" * 15_000 + b" HTTP/1.1\r\nHost: h\r\n\r\n"
    whole = bytes_searched(head, len(head))
    assert whole <= 3 * len(head)
    assert bytes_searched(head, 1) <= 4 * whole
