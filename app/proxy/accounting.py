"""Prompt tokens per API key, for quotas and cost. Pure.

The key itself is never logged nor exported: a label is a short SHA-256 fingerprint of the
bearer token, and the number of distinct labels is bounded so that a client inventing keys
cannot grow the metrics without end.
"""

from __future__ import annotations

import hashlib

ANONYMOUS = "anonymous"
OVERFLOW = "other"


class KeyLabels:
    def __init__(self, max_keys: int = 1000) -> None:
        self.max_keys = max_keys
        self._labels: dict[bytes, str] = {}

    def label(self, authorization: bytes | None) -> str:
        """The metric label for an `Authorization` header value."""
        if not authorization:
            return ANONYMOUS
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return ANONYMOUS
        token = token.strip()
        label = self._labels.get(token)
        if label is not None:
            return label
        if len(self._labels) >= self.max_keys:
            return OVERFLOW
        label = "key-" + hashlib.sha256(token).hexdigest()[:12]
        self._labels[token] = label
        return label
