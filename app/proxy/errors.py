"""The proxy's own error answers that no request check raises: unknown paths, overload, no
backend, a failed backend, a bug of ours. All OpenAI-shaped (app/errors.py); the 4xx that
request checks raise travel as `ClientError` instead."""

from __future__ import annotations

from app.asgi import Send, send_error
from app.proxy.forward import UpstreamFailure
from app.proxy.token_forwarding import no_verified_backend_message
from app.routing.admission import Overloaded

RETRY_AFTER_SECONDS = b"2"


async def send_not_found(send: Send, path: str) -> None:
    await send_error(send, 404, f"Unknown path {path}", "invalid_request_error", None, "not_found")


async def send_method_not_allowed(send: Send, allowed: bytes) -> None:
    await send_error(
        send,
        405,
        f"Method not allowed; use {allowed.decode()}.",
        "invalid_request_error",
        None,
        "method_not_allowed",
        headers=[(b"allow", allowed)],
    )


async def send_no_backend(send: Send, tokenizer_refusals: dict[str, str]) -> None:
    """503: no healthy backend, or (tokens mode) none whose tokenizer is verified."""
    message, code = "No healthy backend is available; try again shortly.", "no_healthy_backend"
    if tokenizer_refusals:
        message, code = no_verified_backend_message(tokenizer_refusals), "no_verified_backend"
    await send_error(
        send,
        503,
        message,
        "service_unavailable",
        None,
        code,
        headers=[(b"retry-after", RETRY_AFTER_SECONDS)],
    )


async def send_overloaded(send: Send, limit: int) -> None:
    await send_error(
        send,
        503,
        f"The proxy is serving its maximum of {limit} requests; try again shortly.",
        "service_unavailable",
        None,
        "overloaded",
        headers=[(b"retry-after", RETRY_AFTER_SECONDS)],
    )


async def send_internal_error(send: Send) -> None:
    await send_error(
        send,
        500,
        "The proxy failed while handling this request; the error is in its log.",
        "internal_error",
        None,
        "internal_error",
    )


async def send_upstream_failure(send: Send, failure: UpstreamFailure) -> None:
    """504 when the backend was too slow to answer, 502 when it could not be reached."""
    if failure.kind == "timeout":
        message = f"The backend did not answer in time ({failure.detail})."
        await send_error(send, 504, message, "upstream_error", None, "backend_timeout")
    else:
        message = f"Could not reach a backend ({failure.detail})."
        await send_error(send, 502, message, "upstream_error", None, "backend_unreachable")


async def send_rate_limited(send: Send, overloaded: Overloaded) -> None:
    """429: the key's tokens per minute, or every backend at its in-flight limit."""
    await send_error(
        send,
        429,
        overloaded.message,
        "rate_limit_error",
        None,
        overloaded.reason,
        headers=[(b"retry-after", overloaded.retry_after_header)],
    )
