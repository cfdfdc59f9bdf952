"""The one error model: every error answer is `error_body`; every refused request a `ClientError`.

OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, is what every client library
parses, so the proxy, the preprocessor, the dashboard and the simulated backend all answer
with it. Code that refuses a request raises `ClientError` wherever it runs — on the event loop,
in a worker thread, or in a render worker process (it pickles with all its fields) — and the
HTTP edge turns it into a response. It lives with HTTP, at the bottom of the house, because
every part of Sluice answers errors and HTTP needs nothing else.
"""

from __future__ import annotations

from typing import Any, Protocol


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorAnswer(Protocol):
    """What an error answer is made of: a `ClientError`, or a refusal of the decision's
    (app/routing/refusal.py), which shares this shape without importing HTTP."""

    status: int
    headers: list[tuple[bytes, bytes]]

    def body(self) -> dict[str, Any]: ...


class ClientError(Exception):
    """A request that cannot be served as sent (a 4xx naming what is wrong: `param`), or not
    now (429, 503 with `Retry-After`; 502, 504 when its backend failed it)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | int | None = None,
        *,
        status: int = 400,
        type_: str = "invalid_request_error",
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type_ = type_
        self.headers = list(headers or ())

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type_, self.param, self.code)

    def __reduce__(self) -> tuple[Any, ...]:
        # The default pickling passes only `args` back to __init__ and loses the keywords.
        fields = (self.message, self.param, self.code, self.status, self.type_, self.headers)
        return (_rebuild, fields)


def _rebuild(
    message: str,
    param: str | None,
    code: str | int | None,
    status: int,
    type_: str,
    headers: list[tuple[bytes, bytes]],
) -> ClientError:
    return ClientError(message, param, code, status=status, type_=type_, headers=headers)
