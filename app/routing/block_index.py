"""Which backend holds which prompt prefix, by blocks of token ids with chained hashes. Pure.

A prompt's token ids are cut in blocks of 16 (vLLM's default KV block size); block i's hash
covers block i-1's hash and its own ids, so one hash names a whole prefix, the way vLLM keys
its prefix cache. For each backend the index keeps the block hashes Sluice sent it, with a
last-use stamp, in least-recently-used order; `max_blocks` bounds the (backend, block) entries
of all backends together, and the entry used least recently anywhere is evicted first.

Design rules:
1. A backend's blocks are always prefix-closed: if it holds block i of a chain it holds
   blocks 0..i-1. `record` stamps a chain tail first, head last, so within a chain an earlier
   block is always more recent than a later one; eviction (oldest first) and `forget_before`
   (everything at or before a stamp) then only ever cut chains from the tail. That is what
   lets `match` binary-search instead of walking, and it keeps evicting what a GPU's LRU
   evicts first: the tail (vLLM frees a sequence's blocks in reverse for the same reason).
   An engine's KV events (`app/kv_events/index.py`) `record` and `discard` blocks as the engine
   stores and evicts them, which keeps the rule for the same reason: the engine evicts
   tails first.
2. Every mutation keeps `len(self) <= max_blocks`; nothing else grows.
3. Hashes are Python's (salted per process): they never leave the process. Anything replicas
   must agree on hashes with hashlib instead (`rendezvous.py`).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from app.errors import require_at_least

BLOCK_SIZE = 16
ROOT_HASH = 0  # what block 0 of every prompt chains from
_ID_BYTES = 4  # array('I') items: the id space of every tokenizer Sluice loads


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """One chained hash per full block; a partial last block is never cached by a backend."""
    return chain_hashes(ROOT_HASH, token_ids, block_size)


def chain_hashes(
    previous: int, token_ids: Sequence[int], block_size: int = BLOCK_SIZE
) -> list[int]:
    """The hashes of the full blocks of `token_ids` continuing the chain that ends in
    `previous` (`ROOT_HASH` at a prompt's start): how an engine's KV events, which name a
    parent and carry the new blocks' ids, become the hashes `block_hashes` gives a prompt."""
    data, item_bytes = _packed(token_ids)
    step = block_size * item_bytes
    hashes: list[int] = []
    # Bytes slices hash in C: ~4x cheaper than a tuple of 16 ints (26 us per 2k tokens).
    for start in range(0, len(data) - step + 1, step):
        previous = hash((previous, data[start : start + step]))
        hashes.append(previous)
    return hashes


def _packed(token_ids: Sequence[int]) -> tuple[bytes, int]:
    """The ids as bytes, 4 each (`array('I')`, every tokenizer Sluice loads), or 8 each for
    ids beyond 32 bits."""
    if isinstance(token_ids, array) and token_ids.itemsize == _ID_BYTES:
        return token_ids.tobytes(), _ID_BYTES
    try:
        return array("I", token_ids).tobytes(), _ID_BYTES
    except OverflowError:
        wide = array("Q", token_ids)
        return wide.tobytes(), wide.itemsize


class BlockIndex:
    def __init__(self, max_blocks: int) -> None:
        require_at_least(1, max_blocks=max_blocks)
        self.max_blocks = max_blocks
        self._held: dict[Hashable, OrderedDict[int, int]] = {}
        self._size = 0
        self._clock = 0
        self.evictions = 0

    def __len__(self) -> int:
        return self._size

    def blocks(self, backend: Hashable) -> int:
        return len(self._held.get(backend, ()))

    def backends(self) -> list[Hashable]:
        return list(self._held)

    def match(self, backend: Hashable, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the backend holds (rule 1: binary search)."""
        held = self._held.get(backend)
        if not held or not hashes or hashes[0] not in held:
            return 0
        low, high = 1, len(hashes)  # held[:low] is known; is held[:high]?
        while low < high:
            middle = (low + high + 1) // 2
            if hashes[middle - 1] in held:
                low = middle
            else:
                high = middle - 1
        return low

    def stamps(self, backend: Hashable, hashes: Sequence[int]) -> list[int]:
        """The last-use stamps of blocks the backend holds, in `hashes` order."""
        held = self._held.get(backend)
        if held is None:
            return []
        return [stamp for stamp in map(held.get, hashes) if stamp is not None]

    def record(self, backend: Hashable, hashes: Sequence[int]) -> None:
        """The backend was sent this chain: it holds every block of it, used just now."""
        self.record_tail(backend, hashes, len(hashes), len(hashes))

    def record_tail(self, backend: Hashable, hashes: Sequence[int], end: int, most: int) -> int:
        """Record the last `most` blocks of `hashes[:end]`, tail first (rule 1), and return
        where they began: a long chain is recorded a slice at a time, from its tail, each
        slice's stamps newer than the last's, so the chain's head ends up newest. Until its
        head is in, a new chain does not match at all (`match` starts at block 0)."""
        start = max(end - most, 0)
        if start >= end:
            return start
        held = self._held.setdefault(backend, OrderedDict())
        for block_hash in reversed(hashes[start:end]):
            self._clock += 1
            if block_hash in held:
                held.move_to_end(block_hash)
            else:
                self._size += 1
            held[block_hash] = self._clock
        while self._size > self.max_blocks:
            self._evict_oldest()
        return start

    def discard(self, backend: Hashable, hashes: Iterable[int]) -> int:
        """The backend no longer holds these blocks (its engine said so); returns how many
        it was known to hold."""
        held = self._held.get(backend)
        if not held:
            return 0
        removed = 0
        for block_hash in hashes:
            if held.pop(block_hash, None) is not None:
                removed += 1
        self._size -= removed
        return removed

    def forget_before(self, backend: Hashable, stamp: int) -> int:
        """Drop the backend's blocks last used at or before `stamp`; returns how many.

        What a backend evicted tells what else it evicted: under LRU, everything it used
        before the evicted block.
        """
        held = self._held.get(backend)
        removed = 0
        while held:
            block_hash, last_use = next(iter(held.items()))
            if last_use > stamp:
                break
            del held[block_hash]
            removed += 1
        self._size -= removed
        return removed

    def remove_backend(self, backend: Hashable) -> None:
        held = self._held.pop(backend, None)
        if held is not None:
            self._size -= len(held)

    def retain(self, backends: Iterable[Hashable]) -> None:
        """Purge every backend not in `backends` (they left the pool)."""
        keep = set(backends)
        for backend in [b for b in self._held if b not in keep]:
            self.remove_backend(backend)

    def _evict_oldest(self) -> None:
        oldest: Hashable | None = None
        oldest_stamp = self._clock + 1
        for backend, held in self._held.items():
            if held:
                stamp = next(iter(held.values()))
                if stamp < oldest_stamp:
                    oldest, oldest_stamp = backend, stamp
        if oldest is None:
            return
        held = self._held[oldest]
        held.popitem(last=False)
        self._size -= 1
        self.evictions += 1
        if not held:
            del self._held[oldest]
