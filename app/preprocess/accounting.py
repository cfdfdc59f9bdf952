"""Prompt tokens per API key, for quotas and cost. Pure.

The key itself is never logged nor exported: a label is a short SHA-256 fingerprint of the
bearer token, and the number of distinct labels is bounded so that a client inventing keys
cannot grow the metrics without end.
"""

from __future__ import annotations

import hashlib

ANONYMOUS = "anonymous"
OVERFLOW = "other"


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header value, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def credential(authorization: bytes | None, api_key: bytes | None) -> bytes | None:
    """The caller's `Authorization` value; Anthropic's SDKs send their key as `x-api-key`,
    which stands for `Authorization: Bearer <key>` when there is no `Authorization`."""
    if authorization or not api_key:
        return authorization
    return b"Bearer " + api_key


def fingerprint(token: bytes) -> str:
    """What stands for a key wherever one must be named: never the key itself."""
    return "key-" + hashlib.sha256(token).hexdigest()[:12]


class KeyLabels:
    def __init__(self, max_keys: int = 1000) -> None:
        self.max_keys = max_keys
        self._labels: dict[bytes, str] = {}

    def label(self, authorization: bytes | None) -> str:
        """The metric label for an `Authorization` header value."""
        token = bearer_token(authorization)
        if token is None:
            return ANONYMOUS
        label = self._labels.get(token)
        if label is not None:
            return label
        if len(self._labels) >= self.max_keys:
            return OVERFLOW
        label = fingerprint(token)
        self._labels[token] = label
        return label
