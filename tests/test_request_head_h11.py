"""The proxy port's request heads (app/http/request_head.py) against h11 as the oracle.

Covers: for arbitrary valid requests written by h11's client side (hypothesis), the same method,
target, version and headers as h11's server side reads; malformed heads both h11 and the reader
refuse (where the reader is deliberately stricter or more lenient, the list says why); and
arbitrary fragments of heads, valid or not, read the same whole and trickling in.
"""

from __future__ import annotations

from typing import Any

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.errors import ClientError
from app.http.request_head import HeadReader
from tests.request_heads import HOST, h11_request, parse_every_way, refusal

TCHAR = "!#$%&'*+-.^_`|~" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
TOKEN = st.text(TCHAR, min_size=1, max_size=20)
TARGET = st.text("".join(map(chr, range(0x21, 0x7F))), min_size=1, max_size=40)
VISIBLE = bytes(range(0x21, 0x7F)) + bytes(range(0x80, 0x100))
# Visible ASCII and obs-text with spaces and tabs inside; h11 writes no surrounding whitespace.
VALUE = st.lists(st.sampled_from([*(bytes([b]) for b in VISIBLE), b" ", b"\t"]), max_size=40).map(
    lambda parts: b"".join(parts).strip(b" \t")
)
# Fields with a meaning of their own: Host is added once, framing and connection options are
# left to the tests above.
SPECIAL = {"host", "content-length", "transfer-encoding", "connection", "expect"}


@given(
    TOKEN,
    TARGET,
    st.lists(st.tuples(TOKEN, VALUE), max_size=8),
    VALUE,
    st.integers(0, 8),
)
def test_any_request_h11_writes_parses_as_h11_reads_it(
    method: str, target: str, fields: list[tuple[str, bytes]], host: bytes, host_at: int
) -> None:
    sent = [(name.encode(), value) for name, value in fields if name.lower() not in SPECIAL]
    sent.insert(min(host_at, len(sent)), (b"Host", host))
    client = h11.Connection(h11.CLIENT)
    data = client.send(h11.Request(method=method, target=target, headers=sent)) or b""
    request = h11_request(data + b"next")

    head, rest = parse_every_way(data + b"next")
    assert rest == b"next"
    assert (head.method, head.target, head.http_version) == (
        request.method,
        request.target,
        request.http_version,
    )
    assert head.headers == list(request.headers)  # lower-case names, same values and order
    # h11's client writes Host first, the other fields in the order given.
    others = [(name.lower(), value) for name, value in sent if name != b"Host"]
    assert head.headers == [(b"host", host), *others]
    assert head.keep_alive and not head.expects_continue
    assert head.body_decoder().done


@pytest.mark.parametrize(
    "data",
    [
        b"GET  / HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET / HTTP/1.1 \r\nHost: h\r\n\r\n",
        b"GET / http/1.1\r\nHost: h\r\n\r\n",
        b"GET / HTTP/1\r\nHost: h\r\n\r\n",
        b"GET /\x7f HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET /\xff HTTP/1.1\r\nHost: h\r\n\r\n",
        b"G(T / HTTP/1.1\r\nHost: h\r\n\r\n",
        b" GET / HTTP/1.1\r\nHost: h\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n",
        b"GET / HTTP/1.1\r\n Host: h\r\n\r\n",
        HOST + b"X-A : b\r\n\r\n",
        HOST + b"X-A\t: b\r\n\r\n",
        HOST + b"X-A: a\x00b\r\n\r\n",
        HOST + b"X-A: a\rb\r\n\r\n",
        HOST + b"X-A: a\x0bb\r\n\r\n",
        HOST + b"X\x00A: b\r\n\r\n",
        HOST + b"no colon\r\n\r\n",
        HOST + b": no name\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",
        HOST + b"Host: h\r\n\r\n",
        HOST + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n",
        HOST + b"Content-Length: 5\r\nContent-Length: 05\r\n\r\n",
        HOST + b"Content-Length: " + b"9" * 30 + b"\r\n\r\n",
        HOST + b"Content-Length: +5\r\n\r\n",
        HOST + b"Content-Length: -1\r\n\r\n",
        HOST + b"Content-Length:\r\n\r\n",
        HOST + b"Transfer-Encoding: gzip\r\n\r\n",
        HOST + b"Transfer-Encoding: gzip, chunked\r\n\r\n",
        HOST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
        # Deliberately stricter than h11, so not listed: h11 unfolds obs-fold lines ("X: a\r\n
        # b" reads as "a b") and accepts Content-Length with Transfer-Encoding, Transfer-
        # Encoding in HTTP/1.0, HTTP/1.2 and HTTP/2.0 request lines, and control characters
        # other than NUL, CR, LF, VT and FF (\x01, \x1b, \x7f) in values; we refuse them all.
        # Deliberately more lenient: h11 refuses empty lines before the request line (RFC 9112
        # §2.2 says a server SHOULD skip at least one); we skip them.
    ],
)
def test_what_h11_refuses_is_refused(data: bytes) -> None:
    with pytest.raises(h11.RemoteProtocolError):
        h11_request(data)
    refusal(data)


# Fragments of heads, valid and not, for whole-versus-trickle comparisons.
FRAGMENT = st.sampled_from(
    [
        b"GET",
        b"POST",
        b" ",
        b"/",
        b" HTTP/1.1",
        b" HTTP/1.0",
        b" HTTP/2.0",
        b"\r\n",
        b"\n",
        b"\r",
        b"\t",
        b"Host: h",
        b"host",
        b":",
        b"a",
        b"\x00",
        b"\xff",
        b"Content-Length: 3",
        b"Transfer-Encoding: chunked",
        b"Connection: close",
    ]
)


def outcome(data: bytes, step: int) -> tuple[Any, ...]:
    """What the reader makes of `data` arriving `step` bytes per read: the head and the rest,
    a refusal, or a wait for more."""
    reader = HeadReader(200)
    unread = b""
    try:
        for start in range(0, len(data), step):
            unread += data[start : start + step]
            head, taken = reader.parse(unread)
            assert 0 <= taken <= len(unread)
            unread = unread[taken:]
            if head is not None:
                return ("head", head, unread + data[start + step :])
    except ClientError as exc:
        assert exc.code == "bad_request"
        return ("refused",)  # the status may differ: a bad request line is refused sooner
    return ("waiting",)


@given(st.lists(FRAGMENT, max_size=40).map(b"".join), st.integers(1, 8))
def test_any_bytes_read_the_same_whole_and_trickling_in(data: bytes, step: int) -> None:
    assert outcome(data, step) == outcome(data, max(len(data), 1))
