"""The proxy's own error answers that no request check raises: unknown paths, overload, a
failed backend (the decision's refusals are app/routing/refusal.py's). Each is a
`ClientError` (app/http/errors.py, OpenAI's shape), so the proxy answers every error one way:
`exchange.respond_client_error`."""

from __future__ import annotations

from app.http.errors import ClientError
from app.proxy.headers import UpstreamFailure

RETRY_AFTER = (b"retry-after", b"2")


def not_found(path: str) -> ClientError:
    return ClientError(f"Unknown path {path}", code="not_found", status=404)


def response_not_found(response_id: str, param: str | None = None) -> ClientError:
    """404 for a stored response Sluice cannot find: not an id it handed out, or its backend
    has left the pool."""
    return ClientError(
        f"No response found with id '{response_id[:200]}'.",
        param,
        "response_not_found",
        status=404,
    )


def method_not_allowed(allowed: bytes) -> ClientError:
    return ClientError(
        f"Method not allowed; use {allowed.decode()}.",
        code="method_not_allowed",
        status=405,
        headers=[(b"allow", allowed)],
    )


def overloaded(limit: int) -> ClientError:
    return ClientError(
        f"The proxy is serving its maximum of {limit} requests; try again shortly.",
        code="overloaded",
        status=503,
        type_="service_unavailable",
        headers=[RETRY_AFTER],
    )


def upstream_failure(failure: UpstreamFailure) -> ClientError:
    """504 when the backend was too slow to answer, 502 when it could not be reached."""
    if failure.kind == "timeout":
        return ClientError(
            f"The backend did not answer in time ({failure.detail}).",
            code="backend_timeout",
            status=504,
            type_="upstream_error",
        )
    return ClientError(
        f"Could not reach a backend ({failure.detail}).",
        code="backend_unreachable",
        status=502,
        type_="upstream_error",
    )
