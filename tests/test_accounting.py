"""API-key labels alone: fingerprints instead of keys, anonymous requests, a bounded set."""

from __future__ import annotations

from app.preprocess.accounting import ANONYMOUS, OVERFLOW, KeyLabels


def test_labels_fingerprint_the_key_and_never_contain_it() -> None:
    labels = KeyLabels()
    first = labels.label(b"Bearer sk-secret-123")
    assert first.startswith("key-") and "secret" not in first
    assert labels.label(b"bearer sk-secret-123") == first
    assert labels.label(b"Bearer other") != first


def test_missing_or_non_bearer_is_anonymous() -> None:
    labels = KeyLabels()
    for value in (None, b"", b"Basic abc", b"Bearer ", b"Bearer"):
        assert labels.label(value) == ANONYMOUS


def test_distinct_keys_are_bounded() -> None:
    labels = KeyLabels(max_keys=2)
    a, b = labels.label(b"Bearer a"), labels.label(b"Bearer b")
    assert labels.label(b"Bearer c") == OVERFLOW
    assert labels.label(b"Bearer a") == a and labels.label(b"Bearer b") == b
