"""A request body as JSON: one object, or a clear 400 saying why not. Pure.

What every JSON endpoint's body goes through first (app/preprocess/request_bodies.py; the
simulated backend reads its bodies the same way), apart from the checks of its fields, so a
body's walk goes through here once and moves on.
"""

from __future__ import annotations

import json
from typing import Any

from app.errors import ClientError

_decode_json = json.JSONDecoder().decode


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise ClientError("The request body is empty; expected a JSON object.")
    try:
        if body[:1] == b"{" and body[1:2] != b"\x00":
            # What json.loads(bytes) decodes an object's UTF-8 text with, without its
            # encoding sniffing (UTF-16 and -32 start with a null byte within two).
            payload = _decode_json(body.decode("utf-8", "surrogatepass"))
        else:
            payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ClientError(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        # CPython's parser recurses once per nesting level; the interpreter's limit ends it.
        raise nested_too_deeply() from None
    if not isinstance(payload, dict):
        raise ClientError("The request body must be a JSON object.")
    return payload


def nested_too_deeply() -> ClientError:
    """For JSON that parses but is too deep to be handled whole (pickled, re-encoded)."""
    return ClientError("The request body is nested too deeply.", None, "nested_too_deeply")
