"""The upstream pool's HTTP/1.1 (app/http/response_head.py), pure, with h11 as the oracle.

Covers: a request's bytes read back by h11's server side as the same request; response heads
parsed whole and then from every prefix (h11's `t_body_reader` habit: None until the head is
complete, then the same answer), interim 1xx heads skipped, keep-alive from the version and
`Connection`, what follows the head kept as the body's start, LF-only lines; refusals of what
h11 refuses (status and header lines, control characters, folded lines, oversized heads, an
unasked 101); and, for arbitrary valid headers, the head h11 writes parsed back to the same
headers.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.http.response_head import MAX_HEAD_BYTES, ProtocolError, ResponseHead, request_bytes


def parse_every_prefix(data: bytes) -> ResponseHead | None:
    """Parse `data` whole; every shorter prefix that ends before the head's end must give
    None, as bytes arriving one at a time would."""
    head = ResponseHead.parse(data)
    assert head is not None
    head_length = len(data) - len(head.rest)
    for end in range(head_length):
        assert ResponseHead.parse(data[:end]) is None
    return head


def test_a_request_reads_back_through_h11_as_sent() -> None:
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"r-1")]
    data = request_bytes(b"gpu-1:8000", b"/v1/chat/completions", headers, b'{"a":1}')
    server = h11.Connection(h11.SERVER)
    server.receive_data(data)
    request = server.next_event()
    assert isinstance(request, h11.Request)
    assert request.method == b"POST" and request.target == b"/v1/chat/completions"
    assert list(request.headers) == [
        (b"host", b"gpu-1:8000"),
        (b"content-length", b"7"),
        *headers,
    ]
    body = server.next_event()
    assert isinstance(body, h11.Data) and body.data == b'{"a":1}'
    assert isinstance(server.next_event(), h11.EndOfMessage)


def test_a_head_is_none_until_whole_then_parsed_with_the_body_start_kept() -> None:
    data = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"X-Padded:   a b  \r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello"
    )
    head = parse_every_prefix(data)
    assert head == ResponseHead(
        200,
        [
            (b"content-type", b"text/event-stream"),
            (b"x-padded", b"a b"),
            (b"transfer-encoding", b"chunked"),
        ],
        keep_alive=True,
        rest=b"5\r\nhello",
    )


@pytest.mark.parametrize(
    ("data", "status", "keep_alive"),
    [
        (b"HTTP/1.1 204 No Content\r\n\r\n", 204, True),
        (b"HTTP/1.1 200\r\ncontent-length: 0\r\n\r\n", 200, True),  # no reason phrase
        (b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", 200, False),
        (b"HTTP/1.1 503 Busy\r\nConnection: Close\r\n\r\n", 503, False),
        (b"HTTP/1.1 200 OK\ncontent-length: 0\n\n", 200, True),  # LF-only lines
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n", 200, True),
        (b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 404 x\r\n\r\n", 404, True),
    ],
)
def test_status_and_keep_alive(data: bytes, status: int, keep_alive: bool) -> None:
    head = parse_every_prefix(data)
    assert head is not None and (head.status, head.keep_alive, head.rest) == (
        status,
        keep_alive,
        b"",
    )


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nname : space before the colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad\x00: name\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\x01b\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\r\n folded\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
    ],
)
def test_what_h11_refuses_is_refused(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        ResponseHead.parse(data)


def test_a_head_that_never_ends_is_refused_past_the_limit() -> None:
    assert ResponseHead.parse(b"HTTP/1.1 200 OK\r\nx: " + b"a" * (MAX_HEAD_BYTES - 30)) is None
    with pytest.raises(ProtocolError):
        ResponseHead.parse(b"HTTP/1.1 200 OK\r\nx: " + b"a" * MAX_HEAD_BYTES)


TOKEN = st.text(
    "!#$%&'*+-.^_`|~" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    min_size=1,
    max_size=20,
)
VALUE = st.binary(max_size=40).map(
    lambda raw: bytes(b for b in raw if b == 9 or 0x20 <= b != 0x7F).strip(b" \t")
)


@given(st.lists(st.tuples(TOKEN, VALUE), max_size=8), st.integers(200, 599))
def test_any_head_h11_writes_parses_to_the_same_headers(
    fields: list[tuple[str, bytes]], status: int
) -> None:
    fields = [(name, value) for name, value in fields if name.lower() not in FRAMING]
    server = h11.Connection(h11.SERVER)
    server.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    server.next_event()
    written = server.send(h11.Response(status_code=status, headers=fields)) or b""
    head = ResponseHead.parse(written + b"body")
    assert head is not None and head.status == status and head.rest == b"body"
    expected = [(name.encode().lower(), value) for name, value in fields]
    assert [pair for pair in head.headers if pair[0] not in FRAMING_BYTES] == expected


FRAMING = {"content-length", "transfer-encoding", "connection"}
FRAMING_BYTES = {name.encode() for name in FRAMING}
