"""The proxy port's request heads refused (app/http/request_head.py), with their status.

Covers: request lines refused as soon as the line is whole (400, or 505 for versions other than
1.x), a first byte that cannot start a method refused at once, a good line waiting for the rest;
header lines that are not fields, control characters in names and values, Host missing or
repeated, ambiguous framing (400) and transfer codings other than chunked (501), each refused
whole and on the byte that completes it when trickling in; the body decoder chosen for the
framings that are unambiguous; oversized heads (431) arriving whole or trickling in; a bare CR
in or before the request line, which h11 refuses too.
"""

from __future__ import annotations

import h11
import pytest

from app.errors import ClientError
from app.http.framing import ChunkedDecoder, LengthDecoder
from app.http.request_head import HeadReader
from tests.request_heads import (
    HOST,
    MAX_HEAD_BYTES,
    h11_request,
    parse_bytewise,
    parse_every_way,
    parse_whole,
    refusal,
    refusal_bytewise,
)


@pytest.mark.parametrize(
    ("line", "status"),
    [
        (b"GET / HTTP/1.1 extra\r\n", 400),
        (b"GET  / HTTP/1.1\r\n", 400),
        (b"GET / HTTP/1.1 \r\n", 400),
        (b"GET /\x7f HTTP/1.1\r\n", 400),
        (b"GET /\xff HTTP/1.1\r\n", 400),
        (b"GET /a b HTTP/1.1\r\n", 400),
        (b"GET / http/1.1\r\n", 400),
        (b"GET / HTTP/1\r\n", 400),
        (b"GET / HTTP/1.10\r\n", 400),
        (b"G(T / HTTP/1.1\r\n", 400),
        (b"GET /\r\n", 400),  # HTTP/0.9
        (b"GET\r\n", 400),
        (b"GET / HTTP/2.0\r\n", 505),
        (b"GET / HTTP/1.2\r\n", 505),
        (b"GET / HTTP/0.9\r\n", 505),
        (b"PRI * HTTP/2.0\r\n", 505),  # HTTP/2's connection preface
    ],
)
def test_a_bad_request_line_is_refused_as_soon_as_it_is_whole(line: bytes, status: int) -> None:
    # No Host, no end of the head: the line alone is enough to refuse.
    assert refusal_bytewise(line + b"Host: h\r\nX: y\r\n\r\n") == (len(line) - 1, status)
    with pytest.raises(ClientError) as caught:
        HeadReader(MAX_HEAD_BYTES).parse(line)
    assert caught.value.status == status
    assert refusal(line + b"Host: h\r\n\r\n") == status


def test_a_good_request_line_waits_for_the_rest_of_the_head() -> None:
    reader = HeadReader(MAX_HEAD_BYTES)
    assert reader.parse(b"GET / HTTP/1.1\r\n") == (None, 0)
    assert reader.parse(b"GET / HTTP/1.1\r\nHost: h\r\n") == (None, 0)
    assert reader.parse(b"GET / HTTP/1.1\r\nHost: h\r\n\r")[0] is None
    head, _ = reader.parse(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert head is not None


@pytest.mark.parametrize(
    "data",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
        b" GET / HTTP/1.1\r\n",
        b"\tGET / HTTP/1.1\r\n",
        b"\x00",
        b"(GET",
        b"\r\n\r\n\x16\x03\x01",  # after empty lines too
    ],
)
def test_a_first_byte_that_cannot_start_a_method_is_refused_at_once(data: bytes) -> None:
    at = len(data) - len(data.lstrip(b"\r\n"))
    assert refusal_bytewise(data) == (at, 400)
    with pytest.raises(ClientError) as caught:
        HeadReader(MAX_HEAD_BYTES).parse(data[: at + 1])
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("data", "status"),
    [
        # header lines that are not fields
        (HOST + b"X-A : b\r\n\r\n", 400),  # whitespace before the colon
        (HOST + b"X-A\t: b\r\n\r\n", 400),
        (HOST + b"X-A: b\r\n folded\r\n\r\n", 400),  # obs-fold
        (HOST + b"X-A: b\r\n\tfolded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n Host: h\r\n\r\n", 400),  # whitespace before the first field
        (HOST + b"X-A: a\x00b\r\n\r\n", 400),  # NUL, CR and control characters in a value
        (HOST + b"X-A: a\rb\r\n\r\n", 400),
        (HOST + b"X-A: a\r \r\n\r\n", 400),
        (HOST + b"X-A: a\x01b\r\n\r\n", 400),
        (HOST + b"X-A: a\x0bb\r\n\r\n", 400),
        (HOST + b"X-A: a\x1bb\r\n\r\n", 400),
        (HOST + b"X-A: a\x7fb\r\n\r\n", 400),
        (HOST + b"X\x00A: b\r\n\r\n", 400),  # and in a name
        (HOST + b"X(A): b\r\n\r\n", 400),
        (HOST + b"no colon\r\n\r\n", 400),
        (HOST + b": no name\r\n\r\n", 400),
        # Host
        (b"GET / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\nX-A: b\n\n", 400),
        (HOST + b"Host: h\r\n\r\n", 400),
        (HOST + b"HOST: other\r\n\r\n", 400),
        # ambiguous framing
        (HOST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (HOST + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", 400),
        (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (HOST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (HOST + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n", 400),
        (HOST + b"Content-Length: 5\r\nContent-Length: 05\r\n\r\n", 400),
        (HOST + b"Content-Length:\r\n\r\n", 400),
        *(  # values that are not one decimal length of at most 18 digits
            (HOST + b"Content-Length: " + value + b"\r\n\r\n", 400)
            for value in (b"5, 6", b"9" * 30, b"1" * 19, b"+5", b"-1", b"0x10", b"1_0")
        ),
        # transfer codings other than chunked
        (HOST + b"Transfer-Encoding: gzip\r\n\r\n", 501),
        (HOST + b"Transfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (HOST + b"Transfer-Encoding: chunked, chunked\r\n\r\n", 501),
    ],
)
def test_a_bad_head_is_refused_with_its_status(data: bytes, status: int) -> None:
    assert refusal(data) == status
    assert refusal_bytewise(data) == (len(data) - 1, status)


@pytest.mark.parametrize(
    ("data", "decoder", "length"),
    [
        (HOST + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\n", LengthDecoder, 5),
        (HOST + b"Content-Length: 5, 5\r\n\r\n", LengthDecoder, 5),
        (HOST + b"Content-Length: 0\r\n\r\n", LengthDecoder, 0),
        (HOST + b"Content-Length: " + b"0" * 17 + b"5\r\n\r\n", LengthDecoder, 5),  # 18 digits
        (HOST + b"\r\n", LengthDecoder, 0),  # no framing: no body
        (b"POST / HTTP/1.0\r\nContent-Length: 5\r\n\r\n", LengthDecoder, 5),
        (HOST + b"Transfer-Encoding: Chunked \r\n\r\n", ChunkedDecoder, None),
    ],
)
def test_a_body_decoder_is_chosen_for_unambiguous_framing(
    data: bytes, decoder: type, length: int | None
) -> None:
    head, _ = parse_every_way(data)
    chosen = head.body_decoder()
    assert isinstance(chosen, decoder)
    if length is not None:
        body = b"x" * length
        assert b"".join(chosen.feed(body + b"NEXT")) == body
        assert chosen.done and chosen.leftover == b"NEXT"


def test_a_head_over_the_limit_is_refused_when_it_arrives_whole() -> None:
    head = b"GET / HTTP/1.1\r\nHost: h\r\nX-Pad: " + b"a" * 60 + b"\r\n\r\n"
    assert parse_whole(head + b"a body far longer than the limit" * 10, len(head))
    assert parse_bytewise(head, len(head))
    assert refusal(head, len(head) - 1) == 431
    assert refusal(head + b"body", len(head) - 1) == 431
    assert refusal_bytewise(head, len(head) - 1) == (len(head) - 1, 431)
    lf_head = head.replace(b"\r\n", b"\n")
    assert refusal(lf_head, len(lf_head) - 1) == 431


def test_a_head_that_never_ends_is_refused_once_past_the_limit() -> None:
    start = b"GET / HTTP/1.1\r\nHost: h\r\nX-Pad: "
    endless = start + b"a" * 200
    # Trickling in: refused when the 101st byte arrives, not before.
    assert refusal_bytewise(endless, 100) == (100, 431)
    # Arriving in one read.
    assert HeadReader(100).parse(endless[:100]) == (None, 0)
    assert refusal(endless[:101], 100) == 431
    # The default limit, h11's.
    reader = HeadReader(MAX_HEAD_BYTES)
    assert reader.parse(start + b"a" * (MAX_HEAD_BYTES - len(start))) == (None, 0)
    with pytest.raises(ClientError) as caught:
        reader.parse(start + b"a" * (MAX_HEAD_BYTES - len(start) + 1))
    assert caught.value.status == 431


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\r\nHost: h\r\n\r\n",
        b"GET / HTTP/1.0\r\r\n\r\n",
        b"\rGET / HTTP/1.1\r\nHost: h\r\n\r\n",
        b"\r\r\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n",
    ],
)
def test_a_bare_cr_in_the_request_line_or_before_it_is_refused(data: bytes) -> None:
    with pytest.raises(h11.RemoteProtocolError):
        h11_request(data)
    assert refusal(data) == 400
