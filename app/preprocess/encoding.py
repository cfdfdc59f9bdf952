"""How Sluice calls the tokenizer, and what it learns about a tokenizer once, at startup.

Every encode is without special tokens (`add_special_tokens=False`): a rendered chat prompt
already holds its BOS, and the L1 cache needs one consistent kind of encode. Completion
prompts get the post-processor's tokens (Llama 3's BOS, for one) added around the result, as
vLLM does with its default `add_special_tokens=True`.
"""

from __future__ import annotations

import functools
import json
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from app.errors import ClientError
from app.preprocess.boundaries import BoundaryFinder, normalizer_is_identity
from app.preprocess.l1_cache import Encode, check_cut_independence
from app.preprocess.tokenizer_loading import LoadedTokenizer, TokenizerLike, TokenizerLoadError

AFFIX_PROBES = ("affix probe 42", "Hello, world!")


def gil_releasing_encoder(tokenizer: TokenizerLike) -> Encode:
    """`encode_batch_fast([text])` releases the GIL while Rust works (and skips offsets),
    unlike `encode`: the event loop keeps running while a worker thread encodes."""

    def encode(text: str) -> array[int]:
        try:
            ids = tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        except TypeError as exc:
            raise _unencodable(text) or exc from exc
        return array("I", ids)

    return encode


def gil_releasing_counter(tokenizer: TokenizerLike) -> Callable[[list[str]], list[int]]:
    """How many tokens each text holds, from one `encode_batch_fast`: the texts are encoded
    in parallel on the tokenizer's own threads (Rayon), with the GIL released."""

    def count(texts: list[str]) -> list[int]:
        try:
            encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        except TypeError as exc:
            raise next(filter(None, map(_unencodable, texts)), None) or exc from exc
        return [len(encoding.ids) for encoding in encodings]

    return count


def naive_encoder(tokenizer: TokenizerLike) -> Encode:
    """What a naive proxy calls on its event loop: `encode`, holding the GIL throughout."""

    def encode(text: str) -> array[int]:
        try:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError as exc:
            raise _unencodable(text) or exc from exc
        return array("I", ids)

    return encode


def _unencodable(text: str) -> ClientError | None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); the tokenizer refuses them with a
    TypeError. That is the client's error, not ours."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        return ClientError(
            f"the prompt contains an unpaired surrogate (U+{ord(text[bad.start]):04X} at "
            f"character {bad.start}), which is not valid Unicode text",
            None,
            "invalid_text",
        )
    return None


@dataclass(frozen=True)
class TokenizerFacts:
    added_tokens: frozenset[str]
    vocab_size: int  # ids at or above are invalid
    finder: BoundaryFinder | None  # None when L1 cannot be used...
    l1_unavailable: str | None  # ...and why
    bos_affix: tuple[int, ...]  # post-processor ids before a single sequence
    eos_affix: tuple[int, ...]  # and after it
    # The most bytes of text one token stands for; None when the normalizer may shrink text,
    # so that bytes bound nothing (length_gate.py).
    max_token_bytes: int | None


@functools.cache
def facts_for(loaded: LoadedTokenizer) -> TokenizerFacts:
    """Cached per loaded tokenizer: building the finder and probing takes ~25 ms."""
    tokenizer = loaded.tokenizer
    decoder = tokenizer.get_added_tokens_decoder()
    finder = BoundaryFinder.for_tokenizer(tokenizer)
    if finder.has_cut_points:
        failure = check_cut_independence(finder, gil_releasing_encoder(tokenizer))
        reason = None if failure is None else f"startup probe failed: {failure}"
    else:
        reason = "the tokenizer has no added tokens to cut prompts at"
    bos, eos = post_processor_affixes(tokenizer)
    return TokenizerFacts(
        added_tokens=frozenset(token.content for token in decoder.values()),
        vocab_size=max(
            tokenizer.get_vocab_size(with_added_tokens=True), max(decoder, default=-1) + 1
        ),
        finder=finder if reason is None else None,
        l1_unavailable=reason,
        bos_affix=bos,
        eos_affix=eos,
        max_token_bytes=max_token_bytes(tokenizer),
    )


def max_token_bytes(tokenizer: TokenizerLike) -> int | None:
    """The longest token, in bytes of the text it covers.

    A byte-level BPE writes each byte as one character of its vocabulary (GPT-2's byte
    alphabet), so its entries' lengths are byte counts. Other vocabularies are measured in
    UTF-8, which over-counts what they decode to (SentencePiece's `▁` is three bytes for one
    space, byte-fallback `<0x41>` six for one): an upper bound, which is what the proof needs.
    """
    if not normalizer_is_identity(tokenizer.normalizer):
        return None
    decoder = tokenizer.decoder
    byte_level = decoder is not None and json.loads(decoder.__getstate__()).get("type") == (
        "ByteLevel"
    )
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=1)
    added = (token.content for token in tokenizer.get_added_tokens_decoder().values())
    return max([longest, *(len(content.encode()) for content in added)])


def post_processor_affixes(tokenizer: TokenizerLike) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids `add_special_tokens=True` puts before and after a single sequence."""
    found = {_affixes_around(tokenizer, probe) for probe in AFFIX_PROBES}
    if len(found) != 1 or None in found:
        raise TokenizerLoadError(
            "this tokenizer's post-processor does more than add tokens around the text; "
            "Sluice cannot tokenize completion prompts for it consistently"
        )
    affixes = found.pop()
    assert affixes is not None
    return affixes


def _affixes_around(
    tokenizer: TokenizerLike, probe: str
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return tuple(full[:i]), tuple(full[i + len(plain) :])
    return None
