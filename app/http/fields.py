"""Header fields as HTTP/1.1 writes them (RFC 9110 §5, RFC 9112 §5). Pure: no I/O.

One reading for both directions: the client's request heads (request_head.py) and the
backends' response heads (upstream_protocol.py). A field is a token, a colon, and a value of
visible characters, spaces and tabs (obs-text allowed), trimmed of the spaces around it. A
line that is anything else is refused, which keeps CR, LF and NUL out of every value the
proxy passes on, and refuses folded lines (obs-fold: a line starting with whitespace), which
RFC 9112 §5.2 lets a recipient reject. One writing too, for the heads the proxy sends both
ways (its answers, exchange.py; its requests to backends, upstream_protocol.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from app.errors import WireError

Headers = list[tuple[bytes, bytes]]

# RFC 9110 §5.1 token; a value of visible characters, spaces and tabs (obs-text allowed).
# The value is matched greedily and its trailing whitespace stripped afterwards: a lazy
# match would try the end of the line after every character (~0.3 µs a field).
_FIELD_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*)")


class FieldError(WireError, ValueError):
    """A header line that is not a field."""


def parse_fields(lines: list[bytes]) -> Headers:
    """The fields of a head's lines (each without its line ending), names in lower case."""
    headers: Headers = []
    match = _FIELD_LINE.fullmatch
    for line in lines:
        field = match(line)
        if field is None:
            raise FieldError(f"invalid header line {line[:60]!r}")
        name, value = field.groups()
        headers.append((name.lower(), value.rstrip(b" \t")))
    return headers


def field(headers: Headers, name: bytes) -> bytes | None:
    """The value of the first field named `name` (lower case), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


def field_lines(headers: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
    """Each field as a line of a head, CRLF included; names and values must be valid ones
    (this module's parse, or the proxy's own)."""
    return [b"%b: %b\r\n" % pair for pair in headers]


def first_values(headers: Headers) -> dict[bytes, bytes]:
    """Each name's first value, what `field` finds: for a head asked for several names."""
    return dict(reversed(headers))
