"""The decision's "no": a request refused for now, as each door answers it.

A refusal is app/errors.py's `Refused`: a status (429: shed or over a budget; 503: nothing
can serve it), OpenAI's error fields and when to try again. Either door answers it through
`answer_for` (the proxy as JSON, the endpoint picker as Envoy's ImmediateResponse), so the
decision imports nothing of HTTP or gRPC.
"""

from __future__ import annotations

import enum

from app.errors import Refused

# Seconds a client is told to wait when nothing can serve it now.
NO_BACKEND_RETRY_S = 2.0


class ShedReason(enum.StrEnum):
    """Why a request was refused with a 429: its error `code` and its metrics label."""

    TOKENS_PER_MINUTE = "tokens_per_minute"  # its key's token budget is spent for now
    REQUEST_TOO_LARGE = "request_too_large"  # more tokens than the budget ever holds
    QUEUE_FULL = "queue_full"  # every backend saturated and the wait queue full
    KEY_QUEUE_FULL = "key_queue_full"  # ... and its key's share of the queue full
    QUEUE_TIMEOUT = "queue_timeout"  # held past what it could wait


class Overloaded(Refused):
    """429: shed from a full wait queue, held past its deadline, or over its key's budget."""

    def __init__(self, reason: ShedReason, message: str, retry_after: float) -> None:
        super().__init__(429, "rate_limit_error", reason.value, message, retry_after)
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
