"""Which headers cross the proxy: the client's to the backend, the backend's to the client.

Hop-by-hop headers (RFC 9110 §7.6.1, and those a `Connection:` header names) stay on their
own connection; the request id is the proxy's; a relayed body's length is the backend's
unless it streams.
"""

from __future__ import annotations

from app.http.client import UpstreamResponse
from app.http.fields import Headers

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
NOT_FORWARDED_UPSTREAM = HOP_BY_HOP | {b"host", b"content-length"}
NOT_RELAYED_DOWNSTREAM = HOP_BY_HOP | {b"content-length"}


def upstream_headers(client_headers: Headers, request_id: bytes) -> Headers:
    """The client's headers minus hop-by-hop ones, with the request id the proxy settled on."""
    kept = [
        (k, v)
        for k, v in client_headers
        if k not in NOT_FORWARDED_UPSTREAM and k != b"x-request-id"
    ]
    kept.append((b"x-request-id", request_id))
    return kept


def _connection_tokens(response: UpstreamResponse) -> set[bytes]:
    """Headers named in `Connection:` are hop-by-hop too (RFC 9110 §7.6.1)."""
    value = response.header(b"connection")
    if not value:
        return set()
    return {token.strip().lower() for token in value.split(b",") if token.strip()}


def downstream_headers(response: UpstreamResponse, extra: Headers) -> Headers:
    named = _connection_tokens(response)
    relayed = [
        (k, v) for k, v in response.headers if k not in NOT_RELAYED_DOWNSTREAM and k not in named
    ]
    if not is_event_stream(response):
        length = response.header(b"content-length")
        if length is not None:
            relayed.append((b"content-length", length))
    return relayed + extra


def is_event_stream(response: UpstreamResponse) -> bool:
    return (response.header(b"content-type") or b"").startswith(b"text/event-stream")
