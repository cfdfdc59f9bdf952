"""The proxy's own error answers that no request check raises: unknown paths, methods,
responses, and a proxy at its bound (the decision's refusals are app/routing/refusal.py's, a
failed backend an `UpstreamError`). Each is a branch of app/errors.py's tree, answered as
`answer_for` says."""

from __future__ import annotations

from app.errors import ClientError, Refused

# Seconds a client is told to wait when the proxy serves its maximum of requests.
OVERLOADED_RETRY_S = 2.0


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


def overloaded(limit: int) -> Refused:
    return Refused(
        503,
        "service_unavailable",
        "overloaded",
        f"The proxy is serving its maximum of {limit} requests; try again shortly.",
        OVERLOADED_RETRY_S,
    )
