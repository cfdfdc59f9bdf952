"""Budgets and feedback plumbing alone: token buckets per API key (refill, charge after the
fact, too-large requests, bounded keys), a 429's Retry-After, and usage read off an answer's
tail. The gate that holds requests: tests/test_admission.py."""

from __future__ import annotations

import math

import pytest

from app.budgets.buckets import TokenBuckets
from app.errors import answer_for
from app.routing.refusal import Overloaded, ShedReason
from app.routing.usage import Usage, usage_from_tail

# --- tokens per minute --------------------------------------------------------------------------


def test_a_key_spends_its_minute_then_waits_for_the_refill() -> None:
    buckets = TokenBuckets()
    assert buckets.take("k", 500, now=0.0, per_minute=600) == 0.0  # 10 tokens a second
    assert buckets.take("k", 200, now=0.0, per_minute=600) == pytest.approx(10.0)  # 100 short
    assert buckets.take("other", 600, now=0.0, per_minute=600) == 0.0  # keys do not share
    assert buckets.take("k", 200, now=10.0, per_minute=600) == 0.0
    assert buckets.level("k", 10.0, per_minute=600) == pytest.approx(0.0)
    # Each key as deep as its own limit.
    assert buckets.take("small", 61, now=0.0, per_minute=60) == math.inf


def test_completion_tokens_are_charged_afterwards_even_below_zero() -> None:
    buckets = TokenBuckets()
    assert buckets.take("k", 50, now=0.0, per_minute=60) == 0.0
    buckets.charge("k", 40, now=0.0, per_minute=60)
    assert buckets.level("k", 0.0, per_minute=60) == pytest.approx(-30.0)
    assert buckets.take("k", 1, now=0.0, per_minute=60) == pytest.approx(31.0)


def test_a_request_larger_than_a_minute_never_fits_and_keys_are_bounded() -> None:
    buckets = TokenBuckets(max_keys=3)
    assert math.isinf(buckets.take("k", 101, now=0.0, per_minute=100))
    for key in range(10):
        buckets.take(f"key-{key}", 1, now=0.0, per_minute=100)
    assert len(buckets) == 3
    with pytest.raises(ValueError):
        buckets.take("k", 0, now=0.0, per_minute=0)


def test_overloaded_says_when_to_retry_in_whole_seconds() -> None:
    busy = answer_for(Overloaded(ShedReason.QUEUE_FULL, "busy", 0.2))
    assert busy.headers == [(b"retry-after", b"1")]
    slow = answer_for(Overloaded(ShedReason.TOKENS_PER_MINUTE, "slow down", 7.01))
    assert slow.headers == [(b"retry-after", b"8")]
    assert (slow.status, slow.body["error"]["code"]) == (429, "tokens_per_minute")


# --- the slot queue -----------------------------------------------------------------------------


# --- usage off the tail ---------------------------------------------------------------------------

WHOLE = (
    b'{"id":"x","choices":[{"index":0,"message":{"content":"hi, \\"usage\\""}}],'
    b'"usage":{"prompt_tokens":2080,"completion_tokens":16,"total_tokens":2096,'
    b'"prompt_tokens_details":{"cached_tokens":2048}}}'
)
STREAM_END = (
    b'data: {"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":4,'
    b'"prompt_tokens_details":{"cached_tokens":16}}}\n\ndata: [DONE]\n\n'
)


def test_usage_is_read_from_whole_answers_and_stream_ends() -> None:
    assert usage_from_tail(WHOLE) == Usage(2080, 16, 2048)
    assert usage_from_tail(STREAM_END) == Usage(30, 4, 16)
    assert usage_from_tail(b'{"usage":{"prompt_tokens":5}}') == Usage(5, None, None)
    assert usage_from_tail(b'data: {"choices":[]}\n\ndata: [DONE]\n\n') is None
    assert usage_from_tail(b'{"usage": null}') is None
