"""Proving a prompt too long for the context window without encoding all of it. Pure.

Two proofs, cheapest first:

1. Bytes. Every token stands for at most `max_token_bytes` bytes of text (the longest
   vocabulary entry, decoded), so a text of B bytes has at least B / max_token_bytes tokens.
   Over `budget * max_token_bytes` bytes it cannot fit: refused from its size alone. This
   holds only when the tokenizer's normalizer cannot shrink the text (none, or an empty
   sequence, as the bundled DeepSeek tokenizer has); otherwise the bound is not used.
2. A counted prefix. Tokens of consecutive chunks add up to the tokens of the text, up to
   what a cut can change: chunks are cut where a word ends, just before a space or newline,
   where every common pre-tokenizer splits anyway, so a cut changes at most a few tokens
   (`CUT_SLACK`). A text with no such place is counted whole.
   Once the chunks counted so far hold more than `budget + slack` tokens, the prompt cannot
   fit, and the rest of it is never encoded. The first chunk is `budget` characters (text
   denser than a character a token proves itself there); each next one is sized from the
   density seen so far to land just past the budget. A chunk is cut in pieces (`next_cuts`)
   that the tokenizer counts at once on all its threads; each cut adds its slack.

A prompt short enough that encoding it whole costs little more than the proof would
(`worth_proving` is false) is simply tokenized whole and checked exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# English runs ~4 characters a token in the DeepSeek and Llama vocabularies, code ~3, CJK ~1.5.
TYPICAL_CHARS_PER_TOKEN = 4
# Tokens a cut may add: a cut where a word ends splits no word, but may split a run of
# whitespace or an added token that holds a space (rare) into a few more tokens.
CUT_SLACK = 32
# A non-space character followed by a space or newline: the cut goes between them.
_WORD_END_BEFORE = re.compile(r"(?<=\S)(?=[ \n])")
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
    """A cut in (start, len(text)] near `start + wanted`, where a space or newline follows a
    non-space: the nearest such place at or before the wanted one (within CUT_SEARCH_CHARS),
    else the first one after it, else the end of the text. Never inside a word."""
    target = min(len(text), start + max(wanted, 1))
    if target == len(text):
        return target
    low = max(start + 1, target - CUT_SEARCH_CHARS)
    before = list(_WORD_END_BEFORE.finditer(text, low, target + 1))
    if before:
        return before[-1].end()
    after = _WORD_END_BEFORE.search(text, target)
    return after.end() if after is not None else len(text)


@dataclass
class PrefixCount:
    """The running proof over one prompt: feed it chunk counts, ask it where to cut next."""

    text: str
    budget: int
    truncated: bool  # `text` is the head of a longer prompt, cut before whitespace
    min_chunk: int = MIN_CHUNK_CHARS
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
        return cut_before_whitespace(self.text, self.position, max(wanted, self.min_chunk))

    def next_cuts(self, pieces: int) -> list[int]:
        """`next_cut`'s chunk cut into about `pieces` pieces where words end, counted at once
        (in parallel): the ends of the pieces. Each cut adds its slack to the proof."""
        end = self.next_cut()
        size = max((end - self.position) // pieces, self.min_chunk)
        cuts: list[int] = []
        start = self.position
        while start < end:
            cut = min(cut_before_whitespace(self.text, start, size), end)
            if end - cut < size // 2:  # no sliver of a last piece
                cut = end
            cuts.append(cut)
            start = cut
        return cuts

    def counted(self, end: int, tokens: int) -> None:
        """The chunk text[position:end] held `tokens` tokens."""
        self.tokens += tokens
        self.position = end
        if end < len(self.text):
            self.cuts += 1
