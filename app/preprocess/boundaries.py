"""Where the tokenizer itself cuts a text at added tokens, found in the raw text.

`tokenizers` encodes in two passes before any normalization or pre-tokenization
(`AddedVocabulary::extract_and_normalize`): (1) it splits the raw text at the added tokens
whose `normalized` flag is false, leftmost-longest with an Aho-Corasick automaton; (2) it
normalizes each remaining piece and splits it at the `normalized` added tokens. Every piece
between those splits is then normalized, pre-tokenized and modelled on its own. The end of
such a split is therefore a place where a prompt can be cut and its two halves tokenized
separately — the premise of the L1 cache (l1_cache.py), which also checks it.

This module re-finds those splits with Python regular expressions built as a trie (same
leftmost-longest, non-overlapping semantics as the automaton, ~0.2 ms per 64 KiB) and keeps
only the cuts it can place exactly:
- tokens with `rstrip` or `single_word` still match (they consume text the way the automaton
  does) but are not cut points: `rstrip` moves the split past following whitespace and
  `single_word` may discard the match, depending on neighbouring characters;
- the second pass is reproduced only when the normalizer is the identity (none, or an empty
  `Sequence`, as in the bundled DeepSeek tokenizer whose User and Assistant tokens are
  `normalized`) and no first-pass token strips whitespace or checks word edges, since
  either would move the edges of the pieces the second pass searches.

The token list comes from the tokenizer (`get_added_tokens_decoder()`), never from a
hard-coded family list: ChatML, Llama 3, DeepSeek and GPT `<|endoftext|>` tokenizers all work
the same way. Pure: no Trio, no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from tokenizers import AddedToken

from app.preprocess.tokenizer_loading import TokenizerLike


class Boundary(NamedTuple):
    start: int  # where the token's text starts
    end: int  # just after it: the cut position
    token_id: int


@dataclass(frozen=True)
class _Pass:
    pattern: re.Pattern[str]
    ids: dict[str, int]  # token text -> id
    cut_points: frozenset[str]  # the token texts a cut may follow


class BoundaryFinder:
    def __init__(self, tokens: Iterable[tuple[int, AddedToken]], identity_normalizer: bool):
        raw = [(i, t) for i, t in tokens if not t.normalized and t.content]
        normalized = [(i, t) for i, t in tokens if t.normalized and t.content]
        self._first = _build_pass(raw)
        edges_move = any(t.lstrip or t.rstrip or t.single_word for _, t in raw)
        self._second = _build_pass(normalized) if identity_normalizer and not edges_move else None
        # Cut-point token texts of each pass, by id: the probes of l1_cache sample them.
        self.cut_tokens_by_pass: list[list[str]] = [
            sorted(p.cut_points, key=p.ids.__getitem__)
            for p in (self._first, self._second)
            if p is not None and p.cut_points
        ]

    @classmethod
    def for_tokenizer(cls, tokenizer: TokenizerLike) -> BoundaryFinder:
        tokens = list(tokenizer.get_added_tokens_decoder().items())
        return cls(tokens, normalizer_is_identity(tokenizer.normalizer))

    @property
    def has_cut_points(self) -> bool:
        return bool(self.cut_tokens_by_pass)

    def find(self, text: str) -> list[Boundary]:
        """The cut points in `text`, in order."""
        found: list[Boundary] = []
        first, second = self._first, self._second
        pos = 0
        if first is not None:
            for m in first.pattern.finditer(text):
                if second is not None and m.start() > pos:
                    _scan(second, text, pos, m.start(), found)
                content = m.group()
                if content in first.cut_points:
                    found.append(Boundary(m.start(), m.end(), first.ids[content]))
                pos = m.end()
        if second is not None and pos < len(text):
            _scan(second, text, pos, len(text), found)
        return found


def normalizer_is_identity(normalizer: Any) -> bool:
    if normalizer is None:
        return True
    state = json.loads(normalizer.__getstate__())
    return bool(state.get("type") == "Sequence" and not state.get("normalizers"))


def _scan(p: _Pass, text: str, start: int, end: int, found: list[Boundary]) -> None:
    for m in p.pattern.finditer(text, start, end):
        content = m.group()
        if content in p.cut_points:
            found.append(Boundary(m.start(), m.end(), p.ids[content]))


def _build_pass(tokens: list[tuple[int, AddedToken]]) -> _Pass | None:
    if not tokens:
        return None
    ids = {t.content: i for i, t in tokens}
    cut_points = frozenset(t.content for _, t in tokens if not (t.rstrip or t.single_word))
    return _Pass(re.compile(trie_pattern(ids)), ids, cut_points)


def trie_pattern(words: Iterable[str]) -> str:
    """A regex matching any of `words`, longest first at each position.

    A flat alternation of ~1,200 tokens scans 64 KiB in ~1.3 ms; factored as a trie, the
    engine rejects a position on its first character, ~0.2 ms.
    """
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # Greedy optional group: a longer token wins over one that ends here.
        return f"(?:{body})?" if "" in node else body

    return emit(trie)
