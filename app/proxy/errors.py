"""The proxy's own error answers that no request check raises: unknown paths, overload, no
backend, a failed backend, a bug of ours. All OpenAI-shaped (app/http/errors.py); the 4xx that
request checks raise travel as `ClientError` instead."""

from __future__ import annotations

from app.http.exchange import Exchange
from app.proxy.forward import UpstreamFailure
from app.proxy.token_forwarding import no_verified_backend_message
from app.routing.admission import Overloaded

RETRY_AFTER_SECONDS = b"2"


async def respond_not_found(exchange: Exchange) -> None:
    await exchange.respond_error(
        404, f"Unknown path {exchange.path}", "invalid_request_error", None, "not_found"
    )


async def respond_method_not_allowed(exchange: Exchange, allowed: bytes) -> None:
    await exchange.respond_error(
        405,
        f"Method not allowed; use {allowed.decode()}.",
        "invalid_request_error",
        None,
        "method_not_allowed",
        headers=[(b"allow", allowed)],
    )


async def respond_no_backend(
    exchange: Exchange, tokenizer_refusals: dict[str, str], model: str | None = None
) -> None:
    """503: no healthy backend (of `model`'s pool), or (tokens mode) none whose tokenizer is
    verified."""
    serving = "" if model is None else f" for model {model}"
    message = f"No healthy backend is available{serving}; try again shortly."
    code = "no_healthy_backend"
    if tokenizer_refusals:
        message, code = no_verified_backend_message(tokenizer_refusals), "no_verified_backend"
    await exchange.respond_error(
        503,
        message,
        "service_unavailable",
        None,
        code,
        headers=[(b"retry-after", RETRY_AFTER_SECONDS)],
    )


async def respond_overloaded(exchange: Exchange, limit: int) -> None:
    await exchange.respond_error(
        503,
        f"The proxy is serving its maximum of {limit} requests; try again shortly.",
        "service_unavailable",
        None,
        "overloaded",
        headers=[(b"retry-after", RETRY_AFTER_SECONDS)],
    )


async def respond_internal_error(exchange: Exchange) -> None:
    await exchange.respond_error(
        500,
        "The proxy failed while handling this request; the error is in its log.",
        "internal_error",
        None,
        "internal_error",
    )


async def respond_upstream_failure(exchange: Exchange, failure: UpstreamFailure) -> None:
    """504 when the backend was too slow to answer, 502 when it could not be reached."""
    if failure.kind == "timeout":
        message = f"The backend did not answer in time ({failure.detail})."
        await exchange.respond_error(504, message, "upstream_error", None, "backend_timeout")
    else:
        message = f"Could not reach a backend ({failure.detail})."
        await exchange.respond_error(502, message, "upstream_error", None, "backend_unreachable")


async def respond_rate_limited(exchange: Exchange, overloaded: Overloaded) -> None:
    """429: the key's tokens per minute, or every backend at its in-flight limit."""
    await exchange.respond_error(
        429,
        overloaded.message,
        "rate_limit_error",
        None,
        overloaded.reason,
        headers=[(b"retry-after", overloaded.retry_after_header)],
    )
