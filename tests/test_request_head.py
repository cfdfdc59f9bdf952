"""The proxy port's request heads (app/http/request_head.py) read whole, from every prefix, and
one byte per read.

Covers: heads parsed whole, then from every prefix (h11's `t_body_reader` habit: None until the
head is complete), then fed one byte per read through a driver that keeps the connection's
unread buffer as `ClientConnection.next_request` does, all three giving the same head and the
same bytes after it (CRLF, LF-only and mixed line endings, padded, empty and obs-text values);
a head split anywhere across reads; pipelined requests read one after another with their
bodies' decoders, a chunked body with extensions and trailers among them; empty lines before a
request line skipped and counted toward the head's size, an endless stream of them refused;
`keep_alive` and `expects_continue` (checked against h11's server side) and `header()`.
Refusals are in test_request_head_refusals.py, h11 as an oracle for arbitrary requests in
test_request_head_h11.py, the cost of a trickling head in test_request_head_cost.py.
"""

from __future__ import annotations

import h11
import pytest

from app.errors import ClientError
from app.http.framing import ChunkedDecoder, LengthDecoder
from app.http.request_head import HeadReader, RequestHead
from tests.request_heads import (
    MAX_HEAD_BYTES,
    parse_bytewise,
    parse_every_way,
    parse_whole,
    read_requests,
    refusal,
    refusal_bytewise,
)

# --- heads parsed whole, from every prefix, and one byte at a time -----------------------------


@pytest.mark.parametrize(
    ("data", "expected", "rest"),
    [
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy:8080\r\n"
            b"Content-Type: application/json\r\nContent-Length: 5\r\n\r\nhello",
            RequestHead(
                b"POST",
                b"/v1/chat/completions",
                b"1.1",
                [
                    (b"host", b"proxy:8080"),
                    (b"content-type", b"application/json"),
                    (b"content-length", b"5"),
                ],
            ),
            b"hello",
        ),
        (  # LF-only line endings
            b"GET /a?b=c HTTP/1.1\nHost: h\nX-A: 1\n\nGET /next",
            RequestHead(b"GET", b"/a?b=c", b"1.1", [(b"host", b"h"), (b"x-a", b"1")]),
            b"GET /next",
        ),
        (  # mixed: LF after the request line, CRLF, then a bare LF ending the head
            b"GET / HTTP/1.1\nHost: h\r\nX-A: 1\r\n\nrest",
            RequestHead(b"GET", b"/", b"1.1", [(b"host", b"h"), (b"x-a", b"1")]),
            b"rest",
        ),
        (  # mixed: LF lines, a CRLF empty line
            b"GET / HTTP/1.1\nHost: h\n\r\nrest\r\n\r\n",
            RequestHead(b"GET", b"/", b"1.1", [(b"host", b"h")]),
            b"rest\r\n\r\n",
        ),
        (  # values padded with spaces and tabs are trimmed; inner whitespace is kept
            b"GET / HTTP/1.1\r\nHost:h\r\nX-Padded:   a  b \t \r\nX-Tab:\ta\tb\t\r\n\r\n",
            RequestHead(
                b"GET",
                b"/",
                b"1.1",
                [(b"host", b"h"), (b"x-padded", b"a  b"), (b"x-tab", b"a\tb")],
            ),
            b"",
        ),
        (  # empty values, with and without whitespace
            b"GET / HTTP/1.1\r\nHost: h\r\nX-Empty:\r\nX-Blank:   \t\r\n\r\n",
            RequestHead(
                b"GET", b"/", b"1.1", [(b"host", b"h"), (b"x-empty", b""), (b"x-blank", b"")]
            ),
            b"",
        ),
        (  # obs-text (bytes 0x80-0xff) in values is passed on as is
            b"GET / HTTP/1.1\r\nHost: h\r\nX-Name: caf\xc3\xa9 \xff\x80\r\n\r\n",
            RequestHead(
                b"GET", b"/", b"1.1", [(b"host", b"h"), (b"x-name", b"caf\xc3\xa9 \xff\x80")]
            ),
            b"",
        ),
        (  # HTTP/1.0 needs no Host, and may have no header at all
            b"GET / HTTP/1.0\r\n\r\n",
            RequestHead(b"GET", b"/", b"1.0", []),
            b"",
        ),
        (  # asterisk-form, absolute-form and authority-form targets; lower-case methods
            b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
            RequestHead(b"OPTIONS", b"*", b"1.1", [(b"host", b"h")]),
            b"",
        ),
        (
            b"get http://h:1/p?q=%20 HTTP/1.1\r\nHost: h:1\r\n\r\n",
            RequestHead(b"get", b"http://h:1/p?q=%20", b"1.1", [(b"host", b"h:1")]),
            b"",
        ),
        (
            b"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n\x16\x03\x01",
            RequestHead(b"CONNECT", b"h:443", b"1.1", [(b"host", b"h:443")]),
            b"\x16\x03\x01",
        ),
    ],
)
def test_a_head_parses_the_same_whole_and_one_byte_at_a_time(
    data: bytes, expected: RequestHead, rest: bytes
) -> None:
    assert parse_every_way(data) == (expected, rest)


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: h\r\nX-A: 1\r\n\r\nrest",
        b"GET / HTTP/1.1\nHost: h\nX-A: 1\n\nrest",
        b"GET / HTTP/1.1\r\nHost: h\nX-A: 1\n\r\nrest",
        b"\r\n\nGET / HTTP/1.0\r\n\r\n",
    ],
)
def test_a_head_split_anywhere_across_reads_parses_the_same(data: bytes) -> None:
    """The reader keeps where its search for the head's end stopped: whatever the first
    read held (part of the request line, of the end's CR LF CR LF, ...), the next reads
    complete the same head."""
    expected = parse_whole(data)
    head_length = len(data) - len(expected[1])
    for first in range(head_length):
        for second in range(first, head_length):
            # Three reads: the connection holds data[:first], then data[:second], then all,
            # less what the reader took each time.
            reader = HeadReader(MAX_HEAD_BYTES)
            got: RequestHead | None = None
            consumed = 0
            for end in (first, second, len(data)):
                got, taken = reader.parse(data[consumed:end])
                consumed += taken
                if got is not None:
                    break
            assert (got, data[consumed:]) == expected, (first, second)


# --- pipelined requests ---------------------------------------------------------------------


PIPELINED = (
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'5;ext=1;name="v"\r\nhello\r\n6 ; another\r\n world\r\n0\r\n'
    b"x-trailer: t\r\nchecksum: abc\r\n\r\n"
    b"\r\n"  # an empty line between requests is skipped
    b"GET /c HTTP/1.1\r\nHost: x\r\n\r\n"
    b"GET /d HTTP/1.0\nContent-Length: 2\n\nok"
)


def test_pipelined_requests_are_read_one_after_another() -> None:
    reader = HeadReader(MAX_HEAD_BYTES)
    unread = PIPELINED

    head, taken = reader.parse(unread)
    assert head is not None and (head.method, head.target) == (b"POST", b"/a")
    unread = unread[taken:]
    decoder = head.body_decoder()
    assert isinstance(decoder, LengthDecoder)
    assert decoder.feed(unread) == [b"hello"] and decoder.done
    unread = decoder.leftover

    head, taken = reader.parse(unread)
    assert head is not None and (head.method, head.target) == (b"POST", b"/b")
    unread = unread[taken:]
    decoder = head.body_decoder()
    assert isinstance(decoder, ChunkedDecoder)
    assert decoder.feed(unread) == [b"hello", b" world"] and decoder.done
    unread = decoder.leftover
    assert unread.startswith(b"\r\nGET /c")

    head, taken = reader.parse(unread)
    assert head is not None and (head.method, head.target) == (b"GET", b"/c")
    assert taken == len(b"\r\nGET /c HTTP/1.1\r\nHost: x\r\n\r\n")
    unread = unread[taken:]
    decoder = head.body_decoder()
    assert decoder.done and decoder.feed(unread) == []
    unread = decoder.leftover

    head, taken = reader.parse(unread)
    assert head is not None and (head.method, head.target, head.http_version) == (
        b"GET",
        b"/d",
        b"1.0",
    )
    decoder = head.body_decoder()
    assert decoder.feed(unread[taken:]) == [b"ok"] and decoder.done and decoder.leftover == b""


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64, len(PIPELINED)])
def test_pipelined_requests_read_the_same_however_the_bytes_arrive(step: int) -> None:
    requests = read_requests(PIPELINED, step)
    assert [(head.method, head.target, body) for head, body in requests] == [
        (b"POST", b"/a", b"hello"),
        (b"POST", b"/b", b"hello world"),
        (b"GET", b"/c", b""),
        (b"GET", b"/d", b"ok"),
    ]


# --- empty lines before the request line ----------------------------------------------------


@pytest.mark.parametrize("empty", [b"\r\n", b"\n", b"\r\n\r\n\n", b"\n\r\n" * 5])
def test_empty_lines_before_a_request_line_are_skipped_and_taken(empty: bytes) -> None:
    data = empty + b"GET / HTTP/1.1\r\nHost: h\r\n\r\nrest"
    head, taken = HeadReader(MAX_HEAD_BYTES).parse(data)
    assert head == RequestHead(b"GET", b"/", b"1.1", [(b"host", b"h")])
    assert data[taken:] == b"rest"
    assert parse_bytewise(data) == (head, b"rest")
    # Only empty lines so far: they are taken, nothing is answered.
    assert HeadReader(MAX_HEAD_BYTES).parse(empty) == (None, len(empty))


def test_empty_lines_count_toward_the_head_size_limit() -> None:
    head = b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"  # 27 bytes
    limit = len(head) + 10
    assert parse_whole(b"\r\n" * 5 + head, limit)[0].target == b"/"
    assert parse_bytewise(b"\r\n" * 5 + head, limit)[0].target == b"/"
    assert refusal(b"\r\n" * 5 + b"\n" + head, limit) == 431
    assert refusal_bytewise(b"\r\n" * 5 + b"\n" + head, limit)[1] == 431


def test_the_empty_lines_counted_start_again_with_each_request() -> None:
    request = b"\r\n" * 5 + b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"
    # Each request is exactly at the limit, empty lines included; together far over it.
    for step in (1, 3, len(request) * 4):
        assert len(read_requests(request * 4, step, len(request))) == 4
    assert refusal(b"\n" + request, len(request)) == 431


def test_an_endless_stream_of_empty_lines_is_refused_past_the_limit() -> None:
    reader = HeadReader(100)
    for _ in range(50):  # 100 bytes: at the limit, not over it
        assert reader.parse(b"\r\n") == (None, 2)
    with pytest.raises(ClientError) as caught:
        reader.parse(b"\r\n")
    assert caught.value.status == 431
    assert refusal(b"\r\n" * 51, 100) == 431
    assert refusal(b"\n" * 101, 100) == 431
    assert HeadReader(100).parse(b"\n" * 100) == (None, 100)


# --- keep-alive, 100-continue and header lookup ----------------------------------------------


def h11_keep_alive(data: bytes) -> bool:
    """Whether h11's server side would keep the connection open after this request."""
    server = h11.Connection(h11.SERVER)
    server.receive_data(data)
    assert isinstance(server.next_event(), h11.Request)
    assert isinstance(server.next_event(), h11.EndOfMessage)
    return bool(server.their_state is h11.DONE)


@pytest.mark.parametrize(
    ("data", "keep_alive"),
    [
        (b"GET / HTTP/1.1\r\nHost: h\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\n\r\n", True),
        (b"GET / HTTP/1.0\r\n\r\n", False),
        (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", True),  # RFC 9112 §9.3
        (b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", True),
        (b"GET / HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: CLOSE\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: h\r\nconnection:   Close  \r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, close\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: TE,close,Upgrade\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nConnection: te\r\nHost: h\r\nConnection: close\r\n\r\n", False),
    ],
)
def test_keep_alive_follows_the_version_and_the_connection_header(
    data: bytes, keep_alive: bool
) -> None:
    head, _ = parse_every_way(data)
    assert head.keep_alive is keep_alive
    # h11 closes every HTTP/1.0 connection; RFC 9112 §9.3 lets a 1.0 client ask to keep it.
    http_1_0_kept = data.startswith(b"GET / HTTP/1.0") and keep_alive
    assert h11_keep_alive(data) is (keep_alive and not http_1_0_kept)


@pytest.mark.parametrize("option", [b"x-closeable", b"closed", b"keep-alive, enclosed"])
def test_only_the_close_option_closes(option: bytes) -> None:
    data = b"GET / HTTP/1.1\r\nHost: h\r\nConnection: " + option + b"\r\n\r\n"
    assert h11_keep_alive(data) is True
    assert parse_whole(data)[0].keep_alive is True


@pytest.mark.parametrize(
    ("data", "expects"),
    [
        (b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\n", True),
        (b"POST / HTTP/1.1\r\nHost: h\r\nEXPECT:  100-Continue \r\n", True),
        (b"POST / HTTP/1.1\r\nHost: h\r\n", False),
        (b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 200-ok\r\n", False),
        (b"POST / HTTP/1.0\r\nExpect: 100-continue\r\n", False),  # ignored (RFC 9110 §10.1.1)
    ],
)
def test_expects_continue_only_for_http_1_1_with_expect_100_continue(
    data: bytes, expects: bool
) -> None:
    data += b"Content-Length: 3\r\n\r\n"
    head, _ = parse_every_way(data)
    assert head.expects_continue is expects
    server = h11.Connection(h11.SERVER)
    server.receive_data(data)
    server.next_event()
    assert server.client_is_waiting_for_100_continue is expects


def test_header_looks_up_the_first_value_by_lower_case_name() -> None:
    head, _ = parse_every_way(
        b"GET / HTTP/1.1\r\nHOST: h\r\nX-Custom: First Value\r\nx-custom: second\r\n"
        b"X-EMPTY:\r\n\r\n"
    )
    assert [name for name, _ in head.headers] == [b"host", b"x-custom", b"x-custom", b"x-empty"]
    assert head.header(b"host") == b"h"
    assert head.header(b"x-custom") == b"First Value"  # values keep their case
    assert head.header(b"x-empty") == b""
    assert head.header(b"x-missing") is None
    assert head.header(b"X-Custom") is None  # names are looked up as stored: lower case
