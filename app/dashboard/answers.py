"""The dashboard's JSON answers as Quart takes them: a body and a status. An error is raised,
a branch of app/errors.py's tree, and `error_response` (the app's error handler) answers it
as `answer_for` says, like the proxy's and the endpoint picker's errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from quart import Response, request

from app.errors import ClientError, answer_for

Answer = tuple[dict[str, Any], int]
# Raises the `ClientError` that says why this write may not happen (who may not), if one may not.
CheckWrite = Callable[[], None]


def error_response(error: BaseException) -> Response:
    answer = answer_for(error)
    headers = {name.decode(): value.decode() for name, value in answer.headers}
    body = json.dumps(answer.body, separators=(",", ":"))
    return Response(body, answer.status, headers, content_type="application/json")


async def json_object(check_write: CheckWrite, example: str) -> dict[str, Any]:
    """A write's body as a JSON object, once `check_write` let it through; a 400 that says
    which shape is expected otherwise."""
    check_write()
    payload = await request.get_json(force=True, silent=True)
    if not isinstance(payload, dict):
        raise ClientError(f"expected a JSON object like {example}")
    return payload
