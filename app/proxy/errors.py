"""The proxy's own error answers, OpenAI-shaped: `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from app.asgi import Send, send_error
from app.proxy.forward import UpstreamFailure
from app.proxy.token_forwarding import no_verified_backend_message

RETRY_AFTER_SECONDS = b"2"


async def send_invalid_request(
    send: Send, message: str, param: str | None, code: str | None
) -> None:
    await send_error(send, 400, message, "invalid_request_error", param, code)


async def send_body_too_large(send: Send, limit: int) -> None:
    await send_error(
        send,
        413,
        f"The request body is larger than {limit} bytes.",
        "invalid_request_error",
        None,
        "request_too_large",
    )


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


async def send_upstream_failure(send: Send, failure: UpstreamFailure) -> None:
    """504 when the backend was too slow to answer, 502 when it could not be reached."""
    if failure.kind == "timeout":
        message = f"The backend did not answer in time ({failure.detail})."
        await send_error(send, 504, message, "upstream_error", None, "backend_timeout")
    else:
        message = f"Could not reach a backend ({failure.detail})."
        await send_error(send, 502, message, "upstream_error", None, "backend_unreachable")
