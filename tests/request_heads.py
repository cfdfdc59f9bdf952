"""Drivers for the proxy port's request-head reader (app/http/request_head.py), shared by the
test_request_head*.py files: a head parsed whole, one byte per read, from every prefix; a
refusal's status, whole and trickling in; pipelined requests read with their bodies' decoders;
and h11's server side reading the same bytes, the oracle the reader is compared with.
"""

from __future__ import annotations

from typing import Any

import h11
import pytest

from app.errors import ClientError
from app.http.connection import DEFAULT_LIMITS
from app.http.request_head import HeadReader, RequestHead

MAX_HEAD_BYTES = DEFAULT_LIMITS.max_head_bytes
# A request line and Host: what most heads in these tests start with.
HOST = b"GET / HTTP/1.1\r\nHost: h\r\n"


def parse_whole(data: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> tuple[RequestHead, bytes]:
    """The head `data` starts with, parsed in one call, and the bytes after it."""
    head, taken = HeadReader(max_head_bytes).parse(data)
    assert head is not None
    return head, data[taken:]


def parse_bytewise(data: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> tuple[RequestHead, bytes]:
    """`data` arriving one byte per read, as `ClientConnection.next_request` reads it: append
    the byte to the unread buffer, parse, drop the bytes taken. The head and what follows it."""
    reader = HeadReader(max_head_bytes)
    unread = b""
    for index in range(len(data)):
        unread += data[index : index + 1]
        head, taken = reader.parse(unread)
        unread = unread[taken:]
        if head is not None:
            assert unread == b"", "the byte that completes a head is the head's"
            return head, data[index + 1 :]
    raise AssertionError("the head never ended")


def parse_every_way(data: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> tuple[RequestHead, bytes]:
    """Parse `data` whole; every shorter prefix that ends before the head's end must give
    None; one byte at a time must give the same head and leave the same bytes."""
    whole = parse_whole(data, max_head_bytes)
    head_length = len(data) - len(whole[1])
    for end in range(head_length):
        assert HeadReader(max_head_bytes).parse(data[:end])[0] is None
    assert parse_bytewise(data, max_head_bytes) == whole
    return whole


def refusal(data: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> int:
    """The status `data`, arriving whole, is refused with, by the reader or by the head's
    `body_decoder` (the connection reads both before anything else)."""
    with pytest.raises(ClientError) as caught:
        head, _ = HeadReader(max_head_bytes).parse(data)
        assert head is not None, "waiting instead of refusing"
        head.body_decoder()
    assert caught.value.code == "bad_request"
    return caught.value.status


def refusal_bytewise(data: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> tuple[int, int]:
    """The index of the byte whose arrival gets `data` refused, one byte per read, and the
    status."""
    reader = HeadReader(max_head_bytes)
    unread = b""
    for index in range(len(data)):
        unread += data[index : index + 1]
        try:
            head, taken = reader.parse(unread)
            unread = unread[taken:]
            if head is not None:
                head.body_decoder()
                raise AssertionError(f"accepted {head!r}")
        except ClientError as exc:
            assert exc.code == "bad_request"
            return index, exc.status
    raise AssertionError("never refused")


def read_requests(
    data: bytes, step: int, max_head_bytes: int = MAX_HEAD_BYTES
) -> list[tuple[RequestHead, bytes]]:
    """Every request in `data` with its body, `step` bytes arriving per read: the head read
    by one HeadReader, the body by the head's decoder, what follows the body kept unread for
    the next head (ClientConnection's next_request and take_body)."""
    reader = HeadReader(max_head_bytes)
    unread = b""
    requests: list[tuple[RequestHead, bytes]] = []
    current: tuple[RequestHead, Any, list[bytes]] | None = None
    for start in range(0, len(data), step):
        unread += data[start : start + step]
        while True:
            if current is None:
                head, taken = reader.parse(unread)
                unread = unread[taken:]
                if head is None:
                    break
                current = (head, head.body_decoder(), [])
            head, decoder, body = current
            if unread and not decoder.done:
                body += decoder.feed(unread)
                unread = decoder.leftover
                decoder.leftover = b""
            if not decoder.done:
                break
            requests.append((head, b"".join(body)))
            current = None
    assert current is None and unread == b""
    return requests


def h11_request(data: bytes) -> h11.Request:
    server = h11.Connection(h11.SERVER)
    server.receive_data(data)
    event = server.next_event()
    assert isinstance(event, h11.Request)
    return event
