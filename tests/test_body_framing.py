"""The relay's body decoders (app/http/framing.py), pure, in h11's `t_body_reader` style:
every case is fed whole, then one byte at a time, then cut at random places (hypothesis),
and must decode to the same content, end at the same place and keep the same leftover.
Covers Content-Length, chunked (extensions, trailers, upper-case hex, zero-length end),
close-delimited bodies, the framing choice from a response head, and the refusals: bad
chunk sizes, a missing CRLF, over-long lines and trailers, a body cut short.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.http.framing import (
    MAX_LINE_BYTES,
    MAX_TRAILER_BYTES,
    BodyDecoder,
    ChunkedDecoder,
    CloseDelimitedDecoder,
    FramingError,
    LengthDecoder,
    chunk,
    decoder_for,
)

Make = Callable[[], BodyDecoder]


def feed_in_pieces(make: Make, wire: bytes, cuts: list[int]) -> tuple[bytes, bool, bytes]:
    decoder = make()
    content = []
    start = 0
    for cut in [*sorted(cuts), len(wire)]:
        content += decoder.feed(wire[start:cut])
        start = cut
    return b"".join(content), decoder.done, decoder.leftover


def check(make: Make, wire: bytes, content: bytes, leftover: bytes = b"") -> None:
    expected = (content, True, leftover)
    assert feed_in_pieces(make, wire, []) == expected
    assert feed_in_pieces(make, wire, list(range(1, len(wire)))) == expected


def refused(make: Make, wire: bytes, match: str) -> None:
    for cuts in ([], list(range(1, len(wire)))):
        with pytest.raises(FramingError, match=match):
            feed_in_pieces(make, wire, cuts)


def test_content_length() -> None:
    check(lambda: LengthDecoder(5), b"hello", b"hello")
    check(lambda: LengthDecoder(5), b"helloHTTP/1.1", b"hello", b"HTTP/1.1")
    check(lambda: LengthDecoder(0), b"", b"")
    decoder = LengthDecoder(5)
    decoder.feed(b"hel")
    with pytest.raises(FramingError, match="2 bytes short"):
        decoder.end_of_input()


def test_chunked() -> None:
    check(ChunkedDecoder, b"5\r\nhello\r\n0\r\n\r\n", b"hello")
    check(ChunkedDecoder, b"5\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\n\r\n", b"hello world!")
    # Upper-case hex, extensions (ignored), whitespace before them, trailers (dropped).
    wire = b"A;name=value\r\n0123456789\r\n1 ;x\r\n!\r\n0\r\nx-trailer: 1\r\n\r\nNEXT"
    check(ChunkedDecoder, wire, b"0123456789!", b"NEXT")
    check(ChunkedDecoder, b"0\r\n\r\n", b"")


def test_chunked_refusals() -> None:
    refused(ChunkedDecoder, b"x\r\n", "invalid chunk-size")
    refused(ChunkedDecoder, b"+5\r\nhello\r\n", "invalid chunk-size")
    refused(ChunkedDecoder, b"0x5\r\nhello\r\n", "invalid chunk-size")
    refused(ChunkedDecoder, b"11111111111111111\r\n", "invalid chunk-size")  # 17 digits
    refused(ChunkedDecoder, b"5\r\nhelloXY0\r\n\r\n", "not followed by CRLF")
    refused(ChunkedDecoder, b"5\r\nhello\rX", "not followed by CRLF")
    refused(ChunkedDecoder, b"1;" + b"x" * MAX_LINE_BYTES, "too long")
    trailer = b"0\r\n" + b"x-t: 1\r\n" * (MAX_TRAILER_BYTES // 8 + 1) + b"\r\n"
    refused(ChunkedDecoder, trailer, "trailer section is too long")
    decoder = ChunkedDecoder()
    decoder.feed(b"5\r\nhel")
    with pytest.raises(FramingError, match="before the last chunk"):
        decoder.end_of_input()


def test_close_delimited_ends_with_the_connection() -> None:
    decoder = CloseDelimitedDecoder()
    assert decoder.feed(b"abc") == [b"abc"] and not decoder.done
    decoder.end_of_input()
    assert decoder.done


def test_a_read_of_whole_chunks_is_one_piece_per_chunk() -> None:
    events = [b"data: %d\n\n" % i for i in range(20)]
    wire = b"".join(chunk(event) for event in events)
    assert ChunkedDecoder().feed(wire) == events


@given(
    st.lists(st.binary(min_size=1, max_size=40), max_size=8),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_any_chunks_cut_anywhere_decode_to_their_content(
    chunks: list[bytes], cuts: list[int]
) -> None:
    wire = b"".join(chunk(c) for c in chunks) + b"0\r\n\r\n"
    cuts = [c for c in cuts if c <= len(wire)]
    assert feed_in_pieces(ChunkedDecoder, wire, cuts) == (b"".join(chunks), True, b"")


def test_framing_is_chosen_as_h11_chooses_it() -> None:
    chunked = [(b"transfer-encoding", b"chunked")]
    assert isinstance(decoder_for(200, chunked, b"POST"), ChunkedDecoder)
    assert isinstance(decoder_for(200, [(b"content-length", b"12")], b"POST"), LengthDecoder)
    assert isinstance(decoder_for(200, [], b"POST"), CloseDelimitedDecoder)
    for status, method in ((204, b"POST"), (304, b"GET"), (200, b"HEAD")):
        assert decoder_for(status, chunked, method).done
    with pytest.raises(FramingError, match="transfer coding"):
        decoder_for(200, [(b"transfer-encoding", b"gzip")], b"POST")
    with pytest.raises(FramingError, match="Content-Length"):
        decoder_for(200, [(b"content-length", b"-1")], b"POST")
