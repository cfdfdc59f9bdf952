"""Proving prompts too long without encoding them whole (app/preprocess/length_gate.py).

The pure pieces alone: where chunks are cut, how the running count sizes the next chunk and
when it declares a prompt too long. Then the proof's premise against the real DeepSeek-V4
tokenizer, property-tested: whenever chunk counts prove a text longer than the budget, a
full encode agrees — the proof never refuses a prompt that fits, whether its chunks are
counted one at a time or cut in pieces counted at once.
"""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from app.preprocess import length_gate
from app.preprocess.encoding import facts_for
from app.preprocess.length_gate import PrefixCount, cut_before_whitespace
from app.preprocess.tokenizer_loading import load_tokenizer


@functools.cache
def tokenizer_count() -> tuple[object, int | None]:
    loaded = load_tokenizer(None)
    return loaded.tokenizer, facts_for(loaded).max_token_bytes


def count(text: str) -> int:
    tokenizer, _ = tokenizer_count()
    return len(tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids)  # type: ignore[attr-defined]


def test_cuts_fall_just_before_whitespace_near_the_wanted_place() -> None:
    text = "alpha beta gamma delta"
    assert cut_before_whitespace(text, 0, 8) == 5  # " beta" starts the next chunk
    assert cut_before_whitespace(text, 6, 100) == len(text)
    assert cut_before_whitespace("x" * 5000, 0, 3000) == 5000  # never inside a word
    assert cut_before_whitespace("x" * 3500 + " y", 0, 3000) == 3500  # the next word end
    assert cut_before_whitespace("a    b", 0, 4) == 1  # not inside a run of spaces
    assert cut_before_whitespace(text, 5, 0) > 5  # always moves forward


def test_the_byte_bound_uses_the_longest_token() -> None:
    _, longest = tokenizer_count()
    assert longest == 128  # DeepSeek-V4's longest entries: 128 spaces, 128 dots
    assert length_gate.too_many_bytes(100 * 128 + 1, 100, longest)
    assert not length_gate.too_many_bytes(100 * 128, 100, longest)
    assert not length_gate.too_many_bytes(10**9, 100, None)  # a shrinking normalizer: no bound
    assert length_gate.least_tokens(100 * 128 + 1, 128) == 101


def test_the_count_stops_once_the_budget_is_passed() -> None:
    text = "word " * 10_000  # one token a word
    proof = PrefixCount(text, budget=1000, truncated=False)
    steps = 0
    while not proof.exhausted and not proof.proven_too_long:
        end = proof.next_cut()
        proof.counted(end, count(text[proof.position : end]))
        steps += 1
    assert proof.proven_too_long and not proof.exhausted
    assert steps <= 3
    assert proof.position < len(text) // 4  # most of the text was never encoded


def test_a_prompt_that_fits_is_never_proven_too_long() -> None:
    text = "word " * 900
    proof = PrefixCount(text, budget=1000, truncated=False)
    while not proof.exhausted and not proof.proven_too_long:
        end = proof.next_cut()
        proof.counted(end, count(text[proof.position : end]))
    assert proof.exhausted and not proof.proven_too_long


def test_a_truncated_head_widens_the_slack() -> None:
    assert PrefixCount("x", 10, truncated=True).slack == length_gate.CUT_SLACK
    assert PrefixCount("x", 10, truncated=False).slack == 0


def test_proving_is_worth_it_only_for_prompts_far_longer_than_the_window() -> None:
    assert not length_gate.worth_proving(length_gate.head_chars(1000), 1000)
    assert length_gate.worth_proving(length_gate.head_chars(1000) + 1, 1000)


PIECES = st.sampled_from(
    ["the", " cat", "  ", "\n", "1234", "中文", "é", ".", "........", " " * 40, "<｜User｜>", "a"]  # noqa: RUF001
)


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(PIECES, min_size=1, max_size=400), budget=st.integers(1, 300))
def test_a_refusal_is_always_right(pieces: list[str], budget: int) -> None:
    text = "".join(pieces)
    proof = PrefixCount(text, budget, truncated=False, min_chunk=1)
    cuts = 0
    while not proof.exhausted and not proof.proven_too_long:
        end = proof.next_cut()
        proof.counted(end, count(text[proof.position : end]))
        cuts += 1
    if proof.proven_too_long:
        assert count(text) > budget


def test_a_chunk_cut_in_pieces_covers_it_whole_each_piece_ending_a_word() -> None:
    text = ("lorem ipsum dolor sit amet " * 4000) + "tail"
    proof = PrefixCount(text, budget=20_000, truncated=False)
    whole = PrefixCount(text, budget=20_000, truncated=False).next_cut()
    ends = proof.next_cuts(8)
    assert ends[-1] == whole and ends == sorted(set(ends)) and 1 < len(ends) <= 9
    starts = [0, *ends[:-1]]
    assert all(text[end] == " " for end in ends[:-1])  # each piece ends where a word ends
    assert all(
        end - start >= length_gate.MIN_CHUNK_CHARS // 2
        for start, end in zip(starts, ends, strict=True)
    )


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(PIECES, min_size=1, max_size=400), budget=st.integers(1, 300))
def test_a_refusal_from_pieces_counted_at_once_is_always_right(
    pieces: list[str], budget: int
) -> None:
    """The proof as the pipeline runs it: several pieces counted in one batch."""
    text = "".join(pieces)
    proof = PrefixCount(text, budget, truncated=False, min_chunk=1)
    while not proof.exhausted and not proof.proven_too_long:
        ends = proof.next_cuts(4)
        tokenizer, _ = tokenizer_count()
        texts = [
            text[start:end] for start, end in zip([proof.position, *ends[:-1]], ends, strict=True)
        ]
        encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)  # type: ignore[attr-defined]
        for end, encoding in zip(ends, encodings, strict=True):
            proof.counted(end, len(encoding.ids))
    if proof.proven_too_long:
        assert count(text) > budget
