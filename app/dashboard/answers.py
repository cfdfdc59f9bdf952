"""The dashboard's JSON answers as Quart takes them: (body, status), errors in OpenAI's shape
by the one body builder (app/http/errors.py)."""

from __future__ import annotations

from typing import Any

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
