"""HTTP/1.1 as the client pool (client.py) speaks it to backends (RFC 9112). Pure: no I/O.

The pool sends one kind of request (a POST whose headers came through request_head.py's
parser on the client side, or are the proxy's own) and reads one response head per
request; bodies are framing.py's. h11 did both with a state machine and an event per step,
~45 µs of CPU a request here (the relay's profile, `python -m load profile`); formatting the
request and parsing the head directly costs a fraction, and the connection's state is the
pool's anyway: a connection is reused only after a body read to its end.

`ResponseHead.parse` is fed the bytes read so far and answers None until the head is whole;
it refuses what h11 would refuse (a malformed status line or header line, a head over
`MAX_HEAD_BYTES`, a 101 nobody asked for) with `ProtocolError`. Lines may end in CRLF or,
leniently as h11 reads them, LF.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.errors import WireError
from app.http.fields import FieldError, Headers, field_lines, parse_fields

MAX_HEAD_BYTES = 65536
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [^\r\n]*)?")


class ProtocolError(WireError, ValueError):
    """The backend's response head is not HTTP/1.1."""


def request_bytes(
    host: bytes, path: bytes, headers: Headers, body: bytes, method: bytes = b"POST"
) -> bytes:
    """A request (a POST of `body`, or a GET or DELETE) with `headers` (valid names and values,
    lower case, without Host, Content-Length or hop-by-hop ones), in one buffer for one write."""
    lines = [b"%b %b HTTP/1.1\r\nhost: %b\r\n" % (method, path, host)]
    if body or method == b"POST":
        lines.append(b"content-length: %d\r\n" % len(body))
    lines += field_lines(headers)
    lines.append(b"\r\n")
    lines.append(body)
    return b"".join(lines)


@dataclass(slots=True)
class ResponseHead:
    status: int
    headers: Headers  # names in lower case
    keep_alive: bool  # HTTP/1.1 and no `Connection: close`
    rest: bytes  # what came after the head: the body's first bytes

    @staticmethod
    def parse(buffer: bytes) -> ResponseHead | None:
        """The head `buffer` starts with, or None while it is incomplete. Interim (1xx)
        responses are skipped: the head returned is the final one."""
        while True:
            end = buffer.find(b"\n\r\n")
            bare = buffer.find(b"\n\n")
            if bare >= 0 and (end < 0 or bare < end):
                end, separator = bare, 2
            else:
                separator = 3
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise ProtocolError(f"a response head longer than {MAX_HEAD_BYTES} bytes")
                return None
            head = _head(buffer[:end], buffer[end + separator :])
            if head.status >= 200:
                return head
            if head.status == 101:
                raise ProtocolError("the backend switched protocols, which was not asked")
            buffer = head.rest


def _head(text: bytes, rest: bytes) -> ResponseHead:
    lines = [line.rstrip(b"\r") for line in text.split(b"\n")]
    match = _STATUS_LINE.fullmatch(lines[0])
    if match is None:
        raise ProtocolError(f"invalid status line {lines[0][:60]!r}")
    try:
        headers = parse_fields(lines[1:])
    except FieldError as exc:
        raise ProtocolError(str(exc)) from None
    keep_alive = match.group(1) == b"1"
    for name, value in headers:
        if name == b"connection" and b"close" in value.lower():
            keep_alive = False
    return ResponseHead(int(match.group(2)), headers, keep_alive, rest)
