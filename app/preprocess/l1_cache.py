"""L1: token ids of prompt prefixes that end at an added-token cut, so a grown conversation
encodes only its new turns.

Why a cut is safe (app/README.md; boundaries.py has the tokenizer internals): for a cut after
added token T at position c, `encode(text) == encode(text[:c]) + encode(T + text[c:])[1:]`.
The suffix is encoded with T in front of it, so that position-dependent steps (`Metaspace`
with `prepend_scheme: first`, `lstrip`/`single_word` checks) see what a full encode sees.
All encodes are without special tokens; whoever needs the post-processor's adds them.

The premise is checked three ways; L1 returns its own ids only when the per-hit checks pass:
1. at startup, `check_cut_independence` runs the identity on probe texts; a failure keeps
   L1 off for this tokenizer;
2. on every hit, structurally: the suffix encode must start with T's id, and every cut token
   in the suffix must appear in the ids as often as in the text; otherwise the request gets
   a full encode and a mismatch is counted;
3. every `verify_every`-th hit, semantically: a full encode is compared with the L1 result;
   a difference turns L1 off for good and the request gets the full encode.

Storage is per segment: the key is a 128-bit BLAKE2b digest of the text up to a cut
(personalised by the tokenizer's namespace: one `L1Store` serves every tokenizer under one
bound), the value the ids since the previous cut as a plain tuple of ints and bytes, which
the garbage collector stops tracking (an `array` or a NamedTuple it would walk at every full
collection). LRU, bounded by bytes; a hit refreshes its chain root-last, so shared roots
(system prompts) go last. Entries sit behind a `threading.Lock` held only for dictionary
work, never while encoding: worker threads and the loop call it at once. Pure: no Trio.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from app.preprocess.boundaries import Boundary, BoundaryFinder

Encode = Callable[[str], "array[int]"]
Result = Literal["hit", "miss", "mismatch", "off"]

# OrderedDict node, the (start, ids, namespace) tuple and its start int: ~171 B an entry
# measured with tracemalloc (20,000 entries), rounded up.
ENTRY_OVERHEAD_BYTES = 176
VERIFY_EVERY = 32


# (character offset of the previous cut, 0 for the first segment; the segment's ids as bytes;
# the namespace of the tokenizer that made it)
Segment = tuple[int, bytes, int]


@dataclass(frozen=True)
class L1Outcome:
    ids: array[int]
    result: Result
    cached_tokens: int = 0  # how many of the ids came from the cache (hits only)


class L1Store:
    """The segments of every tokenizer's L1, in one LRU under one bound (a fleet of models
    shares it: memory stays bounded however many tokenizers there are). Keys carry their
    tokenizer's namespace in the digest, so tokenizers never share segments."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.entries: OrderedDict[bytes, Segment] = OrderedDict()
        self.memory_bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def drop_namespace(self, namespace: int) -> None:
        """Forget one tokenizer's segments (its L1 was turned off); the caller holds the lock."""
        for digest in [d for d, segment in self.entries.items() if segment[2] == namespace]:
            _, packed, _ = self.entries.pop(digest)
            self.memory_bytes -= segment_bytes(digest, packed)


class L1Cache:
    def __init__(
        self,
        finder: BoundaryFinder,
        encode: Encode,
        store: L1Store | int,
        verify_every: int = VERIFY_EVERY,
        namespace: int = 0,
    ) -> None:
        """`store`: the shared segments, or a byte bound for a store of its own."""
        self._finder = finder
        self._encode = encode
        self.store = store if isinstance(store, L1Store) else L1Store(store)
        self._verify_every = verify_every
        # BLAKE2b's personalisation: the same text under two tokenizers, two digests.
        self._namespace = namespace
        self._person = namespace.to_bytes(8, "little") if namespace else b""
        self._lock = self.store.lock
        self._entries = self.store.entries
        self.hits = 0
        self.misses = 0
        self.mismatches = 0
        self.disabled_reason: str | None = None

    def __len__(self) -> int:
        """Segments in the store, every tokenizer's."""
        return len(self._entries)

    def tokenize(self, text: str) -> L1Outcome:
        """Ids of `text` (no special tokens added), equal to `encode(text)`."""
        if self.disabled_reason is not None:
            return L1Outcome(self._encode(text), "off")
        cuts = self._finder.find(text)
        digests = prefix_digests(text, cuts, self._person)
        with self._lock:
            prefix = self._longest_cached_prefix(cuts, digests)
        if not prefix:
            return self._miss(text, cuts, digests)
        return self._hit(text, cuts, digests, prefix)

    def _miss(self, text: str, cuts: list[Boundary], digests: list[bytes]) -> L1Outcome:
        ids = self._encode(text)
        segments = split_at_cuts(ids, cuts)
        with self._lock:
            self.misses += 1
            if segments is not None:
                self._store(cuts, digests, 0, segments)
        return L1Outcome(ids, "miss")

    def _hit(
        self, text: str, cuts: list[Boundary], digests: list[bytes], prefix: list[bytes]
    ) -> L1Outcome:
        reused = len(prefix)
        cut = cuts[reused - 1]
        tail = self._encode(text[cut.start :])  # the cut token, then the new text
        segments = None
        if tail[:1] == array("I", [cut.token_id]):
            segments = split_at_cuts(tail[1:], cuts[reused:])
        if segments is None:  # the structural check failed: trust only a full encode
            with self._lock:
                self.mismatches += 1
            return L1Outcome(self._encode(text), "mismatch")

        ids = array("I")
        for part in prefix:
            ids.frombytes(part)
        ids.extend(tail[1:])

        with self._lock:
            verify = (self.hits + 1) % self._verify_every == 0
        if verify:
            full = self._encode(text)
            if full != ids:
                with self._lock:
                    self.mismatches += 1
                    self.disabled_reason = (
                        f"a sampled L1 result differed from a full encode ({len(ids)} vs "
                        f"{len(full)} tokens): cuts at added tokens are not independent for "
                        f"this tokenizer"
                    )
                    self.store.drop_namespace(self._namespace)
                return L1Outcome(full, "mismatch")
        with self._lock:
            self.hits += 1
            self._store(cuts, digests, reused, segments)
        return L1Outcome(ids, "hit", len(ids) - len(tail) + 1)

    def _longest_cached_prefix(self, cuts: list[Boundary], digests: list[bytes]) -> list[bytes]:
        parts: list[bytes] = []
        previous_cut = 0
        for cut, digest in zip(cuts, digests, strict=True):
            segment = self._entries.get(digest)
            # Same text up to here, and the segment started at our previous cut: same text.
            if segment is None or segment[0] != previous_cut:
                break
            parts.append(segment[1])
            previous_cut = cut.end
        for digest in reversed(digests[: len(parts)]):
            self._entries.move_to_end(digest)
        return parts

    def _store(
        self, cuts: list[Boundary], digests: list[bytes], first: int, segments: list[array[int]]
    ) -> None:
        previous_cut = cuts[first - 1].end if first else 0
        for cut, digest, ids in zip(cuts[first:], digests[first:], segments, strict=True):
            if digest not in self._entries:
                packed = ids.tobytes()
                size = segment_bytes(digest, packed)
                if size <= self.store.max_bytes:
                    self._entries[digest] = (previous_cut, packed, self._namespace)
                    self.store.memory_bytes += size
            previous_cut = cut.end
        while self.store.memory_bytes > self.store.max_bytes:
            digest, (_, packed, _) = self._entries.popitem(last=False)
            self.store.memory_bytes -= segment_bytes(digest, packed)


def prefix_digests(text: str, cuts: Sequence[Boundary], person: bytes = b"") -> list[bytes]:
    """BLAKE2b-128 of `text[:cut.end]` for each cut, in one pass over the text."""
    hasher = hashlib.blake2b(digest_size=16, person=person)
    digests = []
    position = 0
    for cut in cuts:
        hasher.update(text[position : cut.end].encode("utf-8", "surrogatepass"))
        digests.append(hasher.copy().digest())
        position = cut.end
    return digests


def split_at_cuts(ids: array[int], cuts: Sequence[Boundary]) -> list[array[int]] | None:
    """The ids of each segment ending at one of `cuts`, or None if the ids do not hold each
    cut token exactly as often as the text does (then the text was not cut where we think).

    Every added-token match becomes exactly one id and ids follow text order, so when the
    counts agree the n-th occurrence of an id is the n-th cut with that token.
    """
    expected = Counter(cut.token_id for cut in cuts)
    if any(ids.count(token_id) != n for token_id, n in expected.items()):
        return None
    segments = []
    start = 0
    for cut in cuts:
        end = ids.index(cut.token_id, start) + 1
        segments.append(ids[start:end])
        start = end
    return segments


def segment_bytes(digest: bytes, packed_ids: bytes) -> int:
    return sys.getsizeof(digest) + sys.getsizeof(packed_ids) + ENTRY_OVERHEAD_BYTES


def check_cut_independence(finder: BoundaryFinder, encode: Encode) -> str | None:
    """Run the L1 identity on probe texts; the first failure, described, or None."""
    for text in probe_texts(finder):
        full = encode(text)
        cuts = finder.find(text)
        segments = split_at_cuts(full, cuts)
        if segments is None:
            return f"cut tokens in {text!r} do not map one-to-one onto its ids"
        done = 0
        for cut, segment in zip(cuts, segments, strict=True):
            done += len(segment)
            if encode(text[: cut.end]) != full[:done]:
                return f"the ids of {text[: cut.end]!r} change when text follows it"
            tail = encode(text[cut.start :])
            if tail[:1] != array("I", [cut.token_id]) or tail[1:] != full[done:]:
                return f"{text[cut.end :]!r} encodes differently after {text[: cut.end]!r}"
    return None


FILLERS = (
    "",
    "a",
    " a",
    "  two  spaces  ",
    "\n",
    "\n\n",
    "1234567",
    "12 34",
    "héllo wörld",
    "中文字符测试",
    "Hello, world!",
    "\ttab",
    "'s",
    " ",
    "<",
    ">|",
    "xyz",
)


def probe_texts(finder: BoundaryFinder, per_pass: int = 4) -> list[str]:
    """Texts around a spread of cut tokens of each pass: each token between two fillers,
    then two tokens together."""
    tokens = []
    for group in finder.cut_tokens_by_pass:
        step = max(1, len(group) // per_pass)
        tokens.extend(group[::step][:per_pass])
    texts = []
    n = len(FILLERS)
    for k, token in enumerate(tokens):
        for i, left in enumerate(FILLERS):
            right = FILLERS[(i * 7 + k + 3) % n]
            texts.append(left + token + right)
        other = tokens[(k + 1) % len(tokens)]
        texts.append(f"sys{token} user text{other} reply\n{token}{token} 42{other}")
    return texts
