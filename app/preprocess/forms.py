"""The text fields of a `multipart/form-data` body (RFC 7578), such as an audio
transcription's `model`: what routing needs of an upload. Pure.

The body is walked from one delimiter to the next with `bytes.find`, so a 25 MB audio file
is skipped, never copied or decoded; only parts without a filename, of at most
`MAX_FIELD_BYTES`, are read as text. The boundary is the body's own first line (a body must
start with it), so the `Content-Type` header need not be consulted. A body that is not such a
form is a 400 naming what is wrong.
"""

from __future__ import annotations

import re

from app.errors import ClientError

MAX_FIELD_BYTES = 1024
MAX_PARTS = 64
MAX_HEADER_BYTES = 4096
_NAME = re.compile(rb'(?:^|;)\s*name="([^"]*)"', re.IGNORECASE)
_FILENAME = re.compile(rb";\s*filename\*?=", re.IGNORECASE)


def form_fields(body: bytes) -> dict[str, str]:
    """The form's text fields, by name (the first of a repeated name)."""
    first_line = body.find(b"\r\n", 0, 200)
    if not body.startswith(b"--") or first_line < 3:
        raise _bad("the body must be multipart/form-data, starting with its boundary")
    delimiter = b"\r\n" + body[:first_line]
    fields: dict[str, str] = {}
    position = first_line + 2
    for _ in range(MAX_PARTS):
        head_end = body.find(b"\r\n\r\n", position, position + MAX_HEADER_BYTES)
        if head_end < 0:
            raise _bad("a part's headers do not end")
        end = body.find(delimiter, head_end + 4)
        if end < 0:
            raise _bad("the form's closing boundary is missing")
        disposition = _disposition(body[position:head_end])
        name = _NAME.search(disposition) if disposition is not None else None
        if name is not None and _FILENAME.search(disposition or b"") is None:
            value = body[head_end + 4 : end]
            if len(value) <= MAX_FIELD_BYTES:
                fields.setdefault(
                    name.group(1).decode("utf-8", "replace"), value.decode("utf-8", "replace")
                )
        after = end + len(delimiter)
        if body.startswith(b"--", after):
            return fields
        if not body.startswith(b"\r\n", after):
            raise _bad("a boundary is not followed by a line end")
        position = after + 2
    raise _bad(f"more than {MAX_PARTS} parts")


def _disposition(headers: bytes) -> bytes | None:
    for line in headers.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if colon and name.strip().lower() == b"content-disposition":
            return value.strip()
    return None


def _bad(why: str) -> ClientError:
    return ClientError(f"Malformed form: {why}.", None, "invalid_body")
