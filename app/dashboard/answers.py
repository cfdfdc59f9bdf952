"""The dashboard's JSON answers as Quart takes them: (body, status), errors in OpenAI's shape
by the one body builder (app/http/errors.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quart import request

from app.http.errors import error_body

Answer = tuple[dict[str, Any], int]


def error_answer(
    status: int,
    message: str,
    type_: str = "",
    param: str | None = None,
    code: str | None = None,
) -> Answer:
    """`type_` left out: invalid_request_error below 500, server_error from 500 on."""
    kind = type_ or ("invalid_request_error" if status < 500 else "server_error")
    return error_body(message, kind, param, code), status


async def json_object(
    refuse_write: Callable[[], Answer | None], example: str
) -> dict[str, Any] | Answer:
    """A write's body as a JSON object; else the refusal of the write (who may not), or the
    400 that says which shape is expected."""
    refused = refuse_write()
    if refused is not None:
        return refused
    payload = await request.get_json(force=True, silent=True)
    if not isinstance(payload, dict):
        return error_answer(400, f"expected a JSON object like {example}")
    return payload
