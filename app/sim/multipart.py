"""A strict `multipart/form-data` reader (RFC 7578), enough for an audio upload. Pure.

The OpenAI SDK sends `/v1/audio/transcriptions` as one part per field and the audio as a
part with a filename; this reads exactly that shape and refuses the rest: a body must begin
with its first delimiter (no preamble) and end with the close delimiter (at most a CRLF
after it); every part needs `Content-Disposition: form-data; name=...`; header lines may
not fold; a name may appear once; parts and their headers are bounded in number and size.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.errors import WireError

MAX_PARTS = 64
MAX_PART_HEADER_BYTES = 8192
# RFC 2046's boundary characters; a boundary is 1-70 of them and does not end in a space.
_BOUNDARY_CHARS = frozenset(
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? "
)


class FormError(WireError, ValueError):
    """The body is not the multipart/form-data this reader accepts; the message says why."""


@dataclass(frozen=True)
class FormPart:
    name: str
    filename: str | None  # set for a file field, even when empty
    content_type: str | None
    data: bytes

    def text(self) -> str:
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError:
            raise FormError(f"field {self.name!r} is not UTF-8 text") from None


def boundary_of(content_type: bytes | None) -> bytes:
    """The boundary of a `multipart/form-data` Content-Type; FormError for any other type."""
    if content_type is None:
        raise FormError("the request has no Content-Type; expected multipart/form-data")
    try:
        media_type, params = _header_value(content_type.decode("ascii"))
    except UnicodeDecodeError:
        raise FormError("the Content-Type is not ASCII") from None
    if media_type.lower() != "multipart/form-data":
        raise FormError(f"the Content-Type is {media_type!r}; expected multipart/form-data")
    boundary = params.get("boundary", "").encode("ascii", "replace")
    if (
        not 1 <= len(boundary) <= 70
        or boundary.endswith(b" ")
        or not set(boundary) <= _BOUNDARY_CHARS
    ):
        raise FormError("the multipart boundary is missing or malformed")
    return boundary


def read_form(body: bytes, boundary: bytes) -> list[FormPart]:
    delimiter = b"--" + boundary
    if not body.startswith(delimiter):
        raise FormError("the body does not begin with the multipart boundary")
    parts: list[FormPart] = []
    names: set[str] = set()
    position = len(delimiter)
    while True:
        after = body[position : position + 2]
        if after == b"--":
            if body[position + 2 :] not in (b"", b"\r\n"):
                raise FormError("data follows the closing multipart boundary")
            return parts
        if after != b"\r\n":
            raise FormError("a multipart boundary is not followed by CRLF")
        if len(parts) == MAX_PARTS:
            raise FormError(f"more than {MAX_PARTS} parts")
        headers_end = body.find(b"\r\n\r\n", position + 2)
        if headers_end < 0 or headers_end - position > MAX_PART_HEADER_BYTES:
            raise FormError("a part's headers are unterminated or too long")
        data_start = headers_end + 4
        data_end = body.find(b"\r\n" + delimiter, data_start)
        if data_end < 0:
            raise FormError("a part is not closed by the multipart boundary")
        part = _part(body[position + 2 : headers_end], body[data_start:data_end])
        if part.name in names:
            raise FormError(f"field {part.name!r} appears twice")
        names.add(part.name)
        parts.append(part)
        position = data_end + 2 + len(delimiter)


def _part(head: bytes, data: bytes) -> FormPart:
    headers: dict[str, str] = {}
    for line in head.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise FormError("a part has a malformed header line")
        key = name.decode("ascii", "replace").lower()
        if key in headers:
            raise FormError(f"a part repeats its {key} header")
        headers[key] = value.strip().decode("utf-8", "replace")
    disposition = headers.get("content-disposition")
    if disposition is None:
        raise FormError("a part has no Content-Disposition")
    kind, params = _header_value(disposition)
    if kind.lower() != "form-data" or not params.get("name"):
        raise FormError("a part's Content-Disposition is not form-data with a name")
    return FormPart(params["name"], params.get("filename"), headers.get("content-type"), data)


def _header_value(value: str) -> tuple[str, dict[str, str]]:
    """`type; key=value; key="quoted \\"value\\""` into the type and its parameters."""
    pieces = _split_params(value)
    params: dict[str, str] = {}
    for piece in pieces[1:]:
        key, equals, raw = piece.partition("=")
        key = key.strip().lower()
        if not equals or not key or key in params:
            raise FormError(f"a malformed header parameter: {piece.strip()!r}")
        params[key] = _unquote(raw.strip())
    return pieces[0].strip(), params


def _split_params(value: str) -> list[str]:
    pieces: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in value:
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == ";" and not quoted:
            pieces.append("".join(current))
            current = []
            continue
        current.append(char)
    if quoted:
        raise FormError("an unterminated quoted string in a header")
    pieces.append("".join(current))
    return pieces


def _unquote(raw: str) -> str:
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        out: list[str] = []
        escaped = False
        for char in raw[1:-1]:
            if escaped or char != "\\":
                out.append(char)
                escaped = False
            else:
                escaped = True
        return "".join(out)
    if '"' in raw:
        raise FormError(f"a malformed quoted value: {raw!r}")
    return raw
