"""Every error Sluice raises is one tree, and `answer_for` is the one place an error becomes
what a client is told.

    SluiceError        the root: `except SluiceError` catches anything of ours
      ClientError      the client's request cannot be served as sent: a 4xx naming what is
                       wrong (`param`, `code`)
      UpstreamError    the engine failed the request: `fault` says how (no connection, no
                       answer in time, not HTTP, broken off, a fault status): 502 or 504
      Refused          admission says "not now": 429 shed or over a budget, 503 nothing can
                       serve it; `retry_after` in seconds
      ConfigError      Sluice cannot start as configured: `sluice` says why, exit status 2
      WireError        bytes that do not follow their protocol (HTTP framing, HTTP/2, gRPC,
                       KV events), or a peer gone before they were whole: whoever read
                       them turns them into one of the above, or drops the connection

(and, on no branch, app/http/connection.py's `StateError`: a bug of the server's own; and
`require_at_least`'s ValueError: a structure built with bounds it cannot work with, a bug of
its caller's, since flags and files are checked before anything is built from them).

Leaves live beside the code that raises them (app/http/framing.py's `FramingError`,
app/routing/refusal.py's `Overloaded`, ...). Fields are typed: what a caller decides on (a
fault, a status, seconds to wait) is never a string to parse; the strings are the words of
the answer (OpenAI's `type` and `code`, the message).

`answer_for` gives an error's status, headers (Retry-After, Allow) and body, in OpenAI's
shape (`{"error": {"message", "type", "param", "code"}}`, what every client library parses)
or Anthropic's; the proxy, the endpoint picker, the dashboard and the simulated backend
all answer through it. Anything else it is handed is a 500 that says the log has the rest.
Errors pickle with all their fields: a `ClientError` raised in a render worker process
crosses back whole. This module imports nothing of `app`, so every room can raise.
"""

from __future__ import annotations

import enum
import math
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

HeaderPairs = list[tuple[bytes, bytes]]


class SluiceError(Exception):
    """The root of every error Sluice raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own pickling calls __init__ with `args` alone and loses keyword fields.
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(cls: type[SluiceError], args: tuple[Any, ...], fields: dict[str, Any]) -> Any:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(fields)
    return error


class Shape(enum.Enum):
    """Whose error body a client expects."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"  # {"type": "error", "error": {"type", "message"}}


@dataclass(eq=False)  # compared by identity, as exceptions are
class ClientError(SluiceError):
    """A request that cannot be served as sent: a 4xx naming what is wrong (`param`), in
    `shape`. (The simulated backend also answers its engine's own 500 this way, as vLLM
    does.)"""

    message: str
    param: str | None = None
    code: str | int | None = None
    _: KW_ONLY
    status: int = 400
    type_: str = "invalid_request_error"
    headers: HeaderPairs = field(default_factory=list)  # beside the status's own (Allow)
    shape: Shape = Shape.OPENAI

    def __post_init__(self) -> None:
        super().__init__(self.message)


class UpstreamFault(enum.Enum):
    """How an engine failed a request."""

    CONNECT = "connect"  # no connection: refused, unreachable, or none free in time
    TIMEOUT = "timeout"  # no answer (or no byte of it) within its timeout
    PROTOCOL = "protocol"  # what came back is not HTTP, or its framing is broken
    BROKEN = "broken"  # the connection closed or reset before the answer ended
    UNUSABLE = "unusable"  # HTTP, but an answer Sluice cannot pass on as its API says
    STATUS = "status"  # answered with a status that counts against it (a 5xx)


@dataclass(eq=False)
class UpstreamError(SluiceError):
    """The engine failed the request; `detail` says what happened, for the log and the
    client."""

    fault: UpstreamFault
    detail: str

    def __post_init__(self) -> None:
        super().__init__(self.detail)


@dataclass(eq=False)
class Refused(SluiceError):
    """Admission's "not now": 429 (shed, over a budget) or 503 (nothing can serve it), with
    a Retry-After of `retry_after` seconds (rounded up, at least one) when one is known."""

    status: int
    type_: str
    code: str | None
    message: str
    retry_after: float | None

    def __post_init__(self) -> None:
        super().__init__(self.message)


class ConfigError(SluiceError):
    """A configuration that cannot work (a bad value, an unreadable file, a tokenizer or
    template that does not load): `sluice` says why and exits with status 2, as for a bad
    flag."""


class WireError(SluiceError):
    """Bytes that do not follow their protocol, or a peer gone before they were whole; the
    message says where."""


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """What a client is told: a status, the headers that go with it, a JSON body."""

    status: int
    headers: HeaderPairs
    body: dict[str, Any]


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# What each fault is answered with: status, code, and the message around the detail.
_UPSTREAM_ANSWERS = {
    UpstreamFault.TIMEOUT: (504, "backend_timeout", "The backend did not answer in time ({})."),
    UpstreamFault.UNUSABLE: (502, "backend_bad_response", "{}"),
}
_UNREACHABLE = (502, "backend_unreachable", "Could not reach a backend ({}).")
INTERNAL_MESSAGE = "The server failed while handling this request; the error is in its log."


def answer_for(error: BaseException) -> ErrorAnswer:
    """The one mapping from an error to its answer."""
    if isinstance(error, ClientError):
        if error.shape is Shape.ANTHROPIC:
            body = {"type": "error", "error": {"type": error.type_, "message": error.message}}
        else:
            body = error_body(error.message, error.type_, error.param, error.code)
        return ErrorAnswer(error.status, error.headers, body)
    if isinstance(error, Refused):
        headers = []
        if error.retry_after is not None:
            seconds = max(1, math.ceil(error.retry_after))
            headers.append((b"retry-after", b"%d" % seconds))
        return ErrorAnswer(
            error.status, headers, error_body(error.message, error.type_, None, error.code)
        )
    if isinstance(error, UpstreamError):
        status, code, message = _UPSTREAM_ANSWERS.get(error.fault, _UNREACHABLE)
        body = error_body(message.format(error.detail), "upstream_error", None, code)
        return ErrorAnswer(status, [], body)
    return ErrorAnswer(
        500, [], error_body(INTERNAL_MESSAGE, "internal_error", None, "internal_error")
    )


def require_at_least(minimum: float, **bounds: float) -> None:
    """A constructor's check of its bounds: ValueError naming each one under `minimum`."""
    low = [name for name, value in bounds.items() if value < minimum]
    if low:
        raise ValueError(f"{' and '.join(low)} must be at least {minimum}")
