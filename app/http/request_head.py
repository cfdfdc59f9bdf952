"""The client's request heads as the proxy port reads them (RFC 9112 §2-3, §6). Pure: no I/O.

h11 read them until this module: per request its state machine, event objects and header
validation cost ~45 µs of CPU here, 12-13% of the proxy's samples under 32 closed-loop
clients (py-spy), more than the whole of routing. The proxy needs less than h11 gives: it
reads each request's head and whole body, re-frames everything it forwards, and writes its
answers itself (exchange.py). So a head is found and split with bytes methods and checked
with two regular expressions, and the body is decoded by framing.py's decoders, the
ones that read backends' bodies.

`HeadReader.parse` is fed the connection's unread bytes after every read and answers the
head once it is whole, with the number of bytes it took; what follows is the body and then
the next pipelined request. Each byte is searched once however the head arrives (a head
trickling in one byte per read costs no more than one arriving whole), empty lines before a
request line are skipped (RFC 9112 §2.2) and count toward the head's size.

What it refuses, each a `ClientError` with the status RFC 9112 gives it, after which the
connection closes: a first byte that cannot start a method, or a request line that is not
`METHOD TARGET HTTP/x.y` as soon as its line is whole (400, not a wait for the head's end);
a version other than 1.0 and 1.1 (505); a header line that is not a field (obs-fold,
whitespace before the colon, control characters: fields.py) (400); an HTTP/1.1
request without exactly one Host (400); Content-Length and Transfer-Encoding together, or
Transfer-Encoding from an HTTP/1.0 client (400: ambiguous framing, the stuff of request
smuggling); conflicting or malformed lengths (400); a transfer coding other than chunked
(501); a head over `max_head_bytes` (431).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.errors import ClientError
from app.http.fields import FieldError, Headers, field, parse_fields
from app.http.framing import BodyDecoder, FramingError, UnsupportedCoding, request_decoder

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
# RFC 9112 §3: method SP request-target SP HTTP-version; the target is visible characters.
_REQUEST_LINE = re.compile(_TOKEN + rb" ([\x21-\x7e]+) HTTP/([0-9]\.[0-9])")
_METHOD_START = frozenset(
    b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
)
_VERSIONS = frozenset({b"1.0", b"1.1"})


def bad_request(message: str, status: int = 400) -> ClientError:
    return ClientError(message, code="bad_request", status=status)


@dataclass(slots=True)
class RequestHead:
    method: bytes
    target: bytes
    http_version: bytes  # b"1.1" or b"1.0"
    headers: Headers  # names in lower case, values trimmed

    def header(self, name: bytes) -> bytes | None:
        return field(self.headers, name)

    @property
    def path(self) -> str:
        """The target's path, without its query: from the origin form (`/v1/models?x`) or
        the absolute form (`http://host/v1/models`, which RFC 9112 §3.2.2 has servers
        accept); "" for anything else (`*`, an authority), which no route matches."""
        target = self.target
        if target[:1] != b"/":
            scheme, separator, rest = target.partition(b"://")
            if not separator or scheme.lower() not in (b"http", b"https"):
                return ""
            slash = rest.find(b"/")
            target = b"/" if slash < 0 else rest[slash:]
        return target.partition(b"?")[0].decode("latin-1")

    @property
    def keep_alive(self) -> bool:
        """Whether the client may send another request on this connection (RFC 9112 §9.3):
        HTTP/1.1 unless it says `Connection: close`, HTTP/1.0 only if it says `keep-alive`."""
        close = keep_alive = False
        for name, value in self.headers:
            if name == b"connection":
                close = close or _lists(value, b"close")
                keep_alive = keep_alive or _lists(value, b"keep-alive")
        if self.http_version == b"1.1":
            return not close
        return keep_alive and not close

    @property
    def expects_continue(self) -> bool:
        expect = self.header(b"expect")
        return (
            self.http_version == b"1.1" and expect is not None and expect.lower() == b"100-continue"
        )

    def body_decoder(self) -> BodyDecoder:
        """The decoder of this request's body, or a ClientError for framing that is
        ambiguous or unsupported."""
        names = [name for name, _ in self.headers]
        if b"transfer-encoding" in names:
            if b"content-length" in names:
                raise bad_request("A request may not carry Content-Length and Transfer-Encoding.")
            if self.http_version != b"1.1":
                raise bad_request("Transfer-Encoding is not allowed in an HTTP/1.0 request.")
        try:
            return request_decoder(self.headers)
        except UnsupportedCoding as exc:
            raise bad_request(f"{exc}: only chunked is supported", 501) from None
        except FramingError as exc:
            raise bad_request(str(exc)) from None


def _lists(value: bytes, option: bytes) -> bool:
    """Whether a comma-separated header value lists `option` (case-insensitive)."""
    return option in value.lower() and any(
        item.strip() == option for item in value.lower().split(b",")
    )


class HeadReader:
    """Reads the heads at the start of one connection's unread bytes, one request at a time."""

    __slots__ = ("_line_checked", "_max_bytes", "_scanned", "_skipped")

    def __init__(self, max_head_bytes: int) -> None:
        self._max_bytes = max_head_bytes
        self._skipped = 0  # empty lines dropped before this head
        self._scanned = 0  # bytes of the head searched for its end without finding it
        self._line_checked = False

    def parse(self, buffer: bytes) -> tuple[RequestHead | None, int]:
        """The head `buffer` starts with, once whole (else None), and how many bytes of
        `buffer` were taken: the head's, and any empty lines before it."""
        if not buffer:  # asked after every answer, before the next request has come
            return None, 0
        skipped = 0
        while True:  # empty lines: CRLF or LF, never a lone CR (RFC 9112 §2.2)
            if buffer.startswith(b"\r\n", skipped):
                skipped += 2
            elif buffer.startswith(b"\n", skipped):
                skipped += 1
            else:
                break
        if skipped:
            self._skipped += skipped
            buffer = buffer[skipped:]
        if not buffer or buffer == b"\r":
            self._check_size(len(buffer))
            return None, skipped
        if buffer[0] not in _METHOD_START:
            raise bad_request(f"Invalid request line {buffer[:60]!r}.")
        # Searched no further than a head may reach: the buffer may also hold a body.
        start = max(self._scanned - 2, 0)
        stop = min(len(buffer), self._max_bytes - self._skipped + 1)
        end = buffer.find(b"\n\r\n", start, stop)
        bare = buffer.find(b"\n\n", start, stop if end < 0 else end + 2)
        if bare >= 0 and (end < 0 or bare < end):
            end, separator = bare, 2
        else:
            separator = 3
        if end < 0:
            self._check_size(len(buffer))
            if not self._line_checked:
                # No LF before `_scanned` yet, or the line would have been checked.
                line_end = buffer.find(b"\n", self._scanned, stop)
                if line_end >= 0:
                    _request_line(_without_cr(buffer[:line_end]))
                    self._line_checked = True
            self._scanned = len(buffer)
            return None, skipped
        self._check_size(end + separator)
        head = _head(buffer[:end])
        self._skipped = self._scanned = 0
        self._line_checked = False
        return head, skipped + end + separator

    def _check_size(self, head_bytes: int) -> None:
        if self._skipped + head_bytes > self._max_bytes:
            raise bad_request(f"The request head is larger than {self._max_bytes} bytes.", 431)


def _request_line(line: bytes) -> tuple[bytes, bytes, bytes]:
    match = _REQUEST_LINE.fullmatch(line)
    if match is None:
        raise bad_request(f"Invalid request line {line[:60]!r}.")
    version = match.group(2)
    if version not in _VERSIONS:
        raise bad_request(f"HTTP/{version.decode()} is not supported: HTTP/1.1 is.", 505)
    return line.split(b" ", 1)[0], match.group(1), version


def _without_cr(line: bytes) -> bytes:
    """A line without the CR of its CRLF; any other CR stays, to be refused."""
    return line[:-1] if line.endswith(b"\r") else line


def _head(text: bytes) -> RequestHead:
    trimmed = _without_cr(text)  # the last line's CR: the head's end was found by its LF
    if trimmed.count(b"\n") == trimmed.count(b"\r\n"):  # every line ends in CRLF, as usual
        lines = trimmed.split(b"\r\n")
    else:
        lines = [_without_cr(line) for line in text.split(b"\n")]
    method, target, version = _request_line(lines[0])
    try:
        headers = parse_fields(lines[1:])
    except FieldError as exc:
        raise bad_request(f"Malformed request head: {exc}.") from None
    if version == b"1.1" and [name for name, _ in headers].count(b"host") != 1:
        raise bad_request("An HTTP/1.1 request must carry one Host header.")
    return RequestHead(method, target, version, headers)
