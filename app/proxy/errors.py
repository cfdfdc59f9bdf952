"""The proxy's own error answers that no request check raises: unknown paths, overload, no
backend, a failed backend. Each is a `ClientError` (app/http/errors.py, OpenAI's shape), so
the proxy answers every error one way: `exchange.respond_client_error`."""

from __future__ import annotations

from app.http.errors import ClientError
from app.proxy.forward import UpstreamFailure

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


def _unavailable(message: str, code: str) -> ClientError:
    return ClientError(
        message, code=code, status=503, type_="service_unavailable", headers=[RETRY_AFTER]
    )


def no_backend(model: str | None = None, refusals: dict[str, str] | None = None) -> ClientError:
    """503: no healthy backend (of `model`'s pool), or (`--forward tokens`) none whose
    tokenizer is verified: `refusals` says why each was refused."""
    if refusals:
        reasons = "; ".join(f"{url}: {why}" for url, why in refusals.items())
        message = (
            "No backend is verified to tokenize exactly as Sluice does, and --forward tokens "
            f"sends token ids only to such backends ({reasons})."
        )
        return _unavailable(message, "no_verified_backend")
    serving = "" if model is None else f" for model {model}"
    return _unavailable(
        f"No healthy backend is available{serving}; try again shortly.", "no_healthy_backend"
    )


def overloaded(limit: int) -> ClientError:
    return _unavailable(
        f"The proxy is serving its maximum of {limit} requests; try again shortly.", "overloaded"
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
