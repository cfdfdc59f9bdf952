"""What an inference request's head says, read once, and its facts for the decision: the same
for both doors. The proxy reads the head it parsed; the endpoint picker, the head Envoy
forwards to it. Pure.

`Arrival` holds the few headers Sluice acts on: the caller's credential (`Authorization`, or
Anthropic's `x-api-key` standing for it), its W3C `traceparent`, `x-request-id`,
`x-session-id` (a session routes to one backend) and the client's own deadline
(`x-request-timeout`, or the `x-stainless-timeout` the OpenAI SDKs send). `request_facts`
joins them to the preprocessed body and the caller's key: the `RequestFacts` the decision
takes (app/routing/decider.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from app.http.fields import Headers
from app.preprocess.accounting import credential
from app.preprocess.api_keys import KeyGrant
from app.preprocess.pipeline import Prepared
from app.routing.admission import Admission
from app.routing.decider import RequestFacts
from app.routing.decision import RouteRequest
from app.routing.router import estimated_tokens

# A client's own deadline, in seconds: ours, and the one the OpenAI SDKs send.
CLIENT_TIMEOUT_HEADERS = (b"x-request-timeout", b"x-stainless-timeout")
# How much of a body stands in for its prompt when a hash must route it unparsed (bail-out).
ROUTE_KEY_BYTES = 4096
_READ = frozenset(
    {
        b"authorization",
        b"x-api-key",
        b"traceparent",
        b"x-request-id",
        b"x-session-id",
        *CLIENT_TIMEOUT_HEADERS,
    }
)


@dataclass(slots=True)
class Arrival:
    headers: Headers  # all of them, as they came
    credential: bytes | None = None  # an `Authorization` value
    traceparent: bytes | None = None
    request_id: bytes | None = None
    session: bytes | None = None
    timeout: float | None = None  # the client's own deadline, in seconds


def arrival(headers: Headers) -> Arrival:
    """The head's fields Sluice acts on (names lowercase, the first of each counts)."""
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        if name in _READ and name not in found:
            found[name] = value
    timeout = _seconds(found.get(CLIENT_TIMEOUT_HEADERS[0]))
    if timeout is None:
        timeout = _seconds(found.get(CLIENT_TIMEOUT_HEADERS[1]))
    return Arrival(
        headers,
        credential(found.get(b"authorization"), found.get(b"x-api-key")),
        found.get(b"traceparent"),
        found.get(b"x-request-id"),
        found.get(b"x-session-id"),
        timeout,
    )


def request_facts(
    head: Arrival,
    prepared: Prepared,
    body: bytes,
    grant: KeyGrant | None,
    tenant: str,
    arrived_at: float,
    admission_timeout: float,
) -> RequestFacts:
    """`tenant`: the caller's key label; `arrived_at`: when the request came (Trio's clock).
    It may be held `admission_timeout` seconds at most, less if the client says. Its
    priority band is the key's, or the body's `priority` as vLLM takes it, never above the
    key's. Without a prompt of Sluice's (embeddings, uploads), the engine's usage is
    charged."""
    route_key = prepared.prompt or body[:ROUTE_KEY_BYTES].decode("utf-8", "replace")
    session = head.session or prepared.fields.get("user")
    route = RouteRequest(prepared.token_ids, route_key, _session_key(session), prepared.model)
    timeout = admission_timeout if head.timeout is None else min(admission_timeout, head.timeout)
    priority = grant.priority if grant else 0
    asked = prepared.fields.get("priority")
    if isinstance(asked, int) and not isinstance(asked, bool):
        priority = max(priority, asked)
    admitted = prepared.tokenize_path != "none"
    return RequestFacts(
        route=route,
        admission=Admission(tenant, grant.weight if grant else 1.0, priority, arrived_at + timeout),
        tokens_per_minute=grant.tokens_per_minute if grant else None,
        prompt_tokens=estimated_tokens(route) if admitted else 0,
        prompt_admitted=admitted,
    )


def _seconds(value: bytes | None) -> float | None:
    """A header's positive number of seconds, or None."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds > 0 and math.isfinite(seconds) else None


def _session_key(session: Any) -> str | None:
    """`x-session-id` (bytes) or the body's `user` (any JSON): a string, or None."""
    if isinstance(session, bytes):
        return session.decode("latin-1")
    return session if isinstance(session, str) and session else None
