"""Proving a prompt too long for the context window without encoding all of it. Pure.

Two proofs, cheapest first:

1. Bytes. Every token stands for at most `max_token_bytes` bytes of text (the longest
   vocabulary entry, decoded), so a text of B bytes has at least B / max_token_bytes tokens.
   Over `budget * max_token_bytes` bytes it cannot fit: refused from its size alone. This
   holds only when the tokenizer's normalizer cannot shrink the text (none, or an empty
   sequence, as the bundled DeepSeek tokenizer has); otherwise the bound is not used.
2. A counted prefix. Tokens of consecutive chunks add up to the tokens of the text, up to
   what a cut can change: chunks are cut just before a space or newline, where every
   common pre-tokenizer splits anyway, so a cut changes at most a few tokens (`CUT_SLACK`).
   Once the chunks counted so far hold more than `budget + slack` tokens, the prompt cannot
   fit, and the rest of it is never encoded. The first chunk is `budget` characters (text
   denser than a character a token proves itself there); each next one is sized from the
   density seen so far to land just past the budget.

A prompt short enough that encoding it whole costs little more than the proof would
(`worth_proving` is false) is simply tokenized whole and checked exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

# English runs ~4 characters a token in the DeepSeek and Llama vocabularies, code ~3, CJK ~1.5.
TYPICAL_CHARS_PER_TOKEN = 4
# Tokens a whitespace cut may move between the two sides; more if no whitespace was near.
CUT_SLACK = 4
# Where to look back from the wanted cut for whitespace.
CUT_SEARCH_CHARS = 1024
# The smallest chunk worth a trip to a worker thread.
MIN_CHUNK_CHARS = 4096
# Overshoot of the density estimate, so that the last chunk lands past the budget.
OVERSHOOT = 1.1


def head_chars(limit: int) -> int:
    """How much of a prompt the proof may need: beyond this, `worth_proving` holds."""
    return 2 * (limit + CUT_SLACK) * TYPICAL_CHARS_PER_TOKEN


def worth_proving(prompt_chars: int, budget: int) -> bool:
    """True when the prompt is long enough that counting only a prefix saves real work."""
    return prompt_chars > head_chars(budget)


def too_many_bytes(prompt_bytes: int, budget: int, max_token_bytes: int | None) -> bool:
    return max_token_bytes is not None and prompt_bytes > budget * max_token_bytes


def least_tokens(prompt_bytes: int, max_token_bytes: int) -> int:
    return -(-prompt_bytes // max_token_bytes)


def cut_before_whitespace(text: str, start: int, wanted: int) -> int:
    """A cut in (start, len(text)] near `start + wanted`, just before whitespace if any is
    within CUT_SEARCH_CHARS before it."""
    target = min(len(text), start + max(wanted, 1))
    if target == len(text):
        return target
    low = max(start + 1, target - CUT_SEARCH_CHARS)
    found = max(text.rfind(" ", low, target + 1), text.rfind("\n", low, target + 1))
    return found if found > start else target


@dataclass
class PrefixCount:
    """The running proof over one prompt: feed it chunk counts, ask it where to cut next."""

    text: str
    budget: int
    truncated: bool  # `text` is the head of a longer prompt, cut before whitespace
    position: int = 0
    tokens: int = 0
    cuts: int = 0

    @property
    def slack(self) -> int:
        return (self.cuts + self.truncated) * CUT_SLACK

    @property
    def proven_too_long(self) -> bool:
        return self.tokens > self.budget + self.slack

    @property
    def exhausted(self) -> bool:
        return self.position >= len(self.text)

    def next_cut(self) -> int:
        if self.tokens == 0:
            wanted = self.budget + self.slack + CUT_SLACK
        else:
            chars_per_token = self.position / self.tokens
            missing = self.budget + self.slack + CUT_SLACK + 1 - self.tokens
            wanted = int(missing * chars_per_token * OVERSHOOT)
        return cut_before_whitespace(self.text, self.position, max(wanted, MIN_CHUNK_CHARS))

    def counted(self, end: int, tokens: int) -> None:
        """The chunk text[position:end] held `tokens` tokens."""
        self.tokens += tokens
        self.position = end
        if end < len(self.text):
            self.cuts += 1
