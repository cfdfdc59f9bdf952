"""The simulator's stand-in for a tokenizer, and the text it "generates".

The sim has no model, so tokens only need two properties: the same text always gives the same
ids, and texts that share a prefix give ids that share a prefix (that is what makes the prefix
KV cache hit). Each chunk of leading whitespace plus a word becomes one id, roughly one token a
word like a real BPE vocabulary. A real tokenizer can replace it through `TextTokenizer`:
`SimSettings.tokenize_with` names one ("default" is Sluice's own), which is what lets the
proxy's `--forward tokens` verify a simulated backend and send it token ids.
"""

from __future__ import annotations

import random
import re
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from app.preprocess.tokenizer_loading import TokenizerLike, load_tokenizer

# DeepSeek-V4's vocabulary size, so simulated ids look like the real model's.
VOCAB_SIZE = 129_280

_CHUNK = re.compile(r"\s*\S+|\s+")

_OUTPUT_VOCABULARY = (
    "the of and to in is that for it as with on was by at be this are from or an which "
    "have not but had they has were their one all been more when there can so if will "
    "would about cache token prefix block batch decode prefill latency router backend "
    "stream queue model request server kernel memory tensor layer attention value key "
    "sequence window context "
)
_OUTPUT_WORDS = tuple(_OUTPUT_VOCABULARY.split())
# How many recently encoded texts the word tokenizer keeps to decode ids back (/detokenize).
RECENT_TEXTS = 256


class TextTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...  # ids at or above are out of vocabulary

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class WordTokenizer:
    """Deterministic across processes (crc32, not the salted built-in `hash`).

    A hash cannot be inverted, so `decode` reads ids back from the texts it encoded lately
    and from the words the sim generates; any other id comes back as `<id>`. Keeping the
    texts, not a map per chunk, costs `encode` (on every simulated request) one append.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self) -> None:
        self._recent: deque[str] = deque(maxlen=RECENT_TEXTS)

    def encode(self, text: str) -> list[int]:
        self._recent.append(text)
        # Inline, not through `_word_id`: a call per word would cost long prompts.
        return [zlib.crc32(chunk.encode()) % VOCAB_SIZE for chunk in _CHUNK.findall(text)]

    def decode(self, ids: Sequence[int]) -> str:
        known = {_word_id(chunk): chunk for chunk in _output_chunks()}
        for text in self._recent:
            known.update((_word_id(chunk), chunk) for chunk in _CHUNK.findall(text))
        return "".join(known.get(token, f"<{token}>") for token in ids)


def _word_id(chunk: str) -> int:
    return zlib.crc32(chunk.encode()) % VOCAB_SIZE


def _output_chunks() -> Iterator[str]:
    for word in _OUTPUT_WORDS:
        yield word
        yield " " + word


@runtime_checkable
class _Decoding(Protocol):
    """`tokenizers.Tokenizer.decode`, which the proxy's `TokenizerLike` leaves out."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class RealTokenizer:
    """A `tokenizers.Tokenizer` as the sim's `TextTokenizer`: no post-processor tokens, as
    the proxy encodes prompts and asks /tokenize for its probe."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        if not isinstance(self._tokenizer, _Decoding):
            raise ValueError("this tokenizer cannot decode")
        # vLLM's /detokenize keeps special tokens (Hugging Face's `decode` default).
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def sim_tokenizer(spec: str) -> TextTokenizer:
    """What `SimSettings.tokenize_with` names: "words", "default" or a `load_tokenizer` path."""
    if spec == "words":
        return WordTokenizer()
    return RealTokenizer(load_tokenizer(None if spec == "default" else spec).tokenizer)


def message_text(content: Any) -> str:
    """The text of an OpenAI message `content`: a string, null, or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    raise ValueError("message content must be a string, null or a list of content parts")


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """A fixed chat "template": one `role: content` line per message, then the reply prompt.

    Appending a turn only appends text, so a conversation's later turns share the earlier
    turns' token prefix, as they would under a real template.
    """
    lines = [f"{message['role']}: {message_text(message.get('content'))}\n" for message in messages]
    return "".join(lines) + "assistant:"


def generated_pieces(prompt_tokens: Sequence[int], seed: int) -> Iterator[str]:
    """An endless, reproducible stream of output token texts for this prompt."""
    rng = random.Random(f"{seed}:{hash(tuple(prompt_tokens))}")
    first = True
    while True:
        word = rng.choice(_OUTPUT_WORDS)
        yield word if first else " " + word
        first = False
