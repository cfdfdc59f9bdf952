"""The decision's "no": a request refused for now, as each door answers it.

A refusal is a status (429: shed or over a budget; 503: nothing can serve it), OpenAI's error
fields and when to try again. The proxy answers it as JSON, the endpoint picker as Envoy's
ImmediateResponse: both take `status`, `headers` and `body()`, so neither door translates and
the decision imports nothing of HTTP or gRPC.
"""

from __future__ import annotations

import math
from typing import Any

# Seconds a client is told to wait when nothing can serve it now.
NO_BACKEND_RETRY_S = 2.0


class Refused(Exception):
    """Refused for now, with Retry-After (whole seconds, at least one)."""

    def __init__(
        self, status: int, type_: str, code: str, message: str, retry_after: float
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type_ = type_
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.headers = [(b"retry-after", str(max(1, math.ceil(retry_after))).encode())]

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type_, "param": None, "code": self.code}
        }


class Overloaded(Refused):
    """429: shed from a full wait queue, held past its deadline, or over its key's budget."""

    def __init__(self, reason: str, message: str, retry_after: float) -> None:
        super().__init__(429, "rate_limit_error", reason, message, retry_after)
        # tokens_per_minute | request_too_large | queue_full | key_queue_full | queue_timeout
        self.reason = reason


def no_backend(model: str | None = None, refusals: dict[str, str] | None = None) -> Refused:
    """503: no backend (of `model`'s pool, or of the gateway's subset) takes traffic, or
    (`--forward tokens`) none whose tokenizer is verified: `refusals` says why each was
    refused."""
    if refusals:
        reasons = "; ".join(f"{url}: {why}" for url, why in refusals.items())
        message = (
            "No backend is verified to tokenize exactly as Sluice does, and --forward tokens "
            f"sends token ids only to such backends ({reasons})."
        )
        return Refused(
            503, "service_unavailable", "no_verified_backend", message, NO_BACKEND_RETRY_S
        )
    serving = "" if model is None else f" for model {model}"
    return Refused(
        503,
        "service_unavailable",
        "no_healthy_backend",
        f"No healthy backend is available{serving}; try again shortly.",
        NO_BACKEND_RETRY_S,
    )
