"""L0: exact prompt text -> token ids, LRU, bounded by entry count and by bytes.

System prompts and retried requests repeat verbatim; a hit costs one string hash (~12 µs for
64 KiB, cached afterwards by the str object) and a copy of the ids, instead of ~1 ms per 1k
tokens of encoding.

Texts longer than `max_text_bytes` are not cached. The default is 64 KiB, not 8 KiB: the long,
stable system prefixes are exactly the ones worth caching (an 8 KiB cap cost 5-7 ms at
p50). Ids are stored as the bytes of an `array('I')`: 4 bytes per
token instead of ~36 for a list of ints, and bytes, unlike an array, are not tracked by the
garbage collector, which would otherwise walk every entry on each full collection (see
l1_cache.py). Pure: used from the event loop only, no locking, no Trio.

One cache serves every tokenizer of a fleet: an entry's key is (the tokenizer's namespace,
the text), so two tokenizers never share ids while their entries share one LRU and one
bound, however many models there are.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict

# The OrderedDict node, its hash slot and the (namespace, text) key tuple: ~131 bytes an entry
# measured with tracemalloc (20,000 entries); 160 covers the table's over-allocation.
ENTRY_OVERHEAD_BYTES = 160


class L0Cache:
    def __init__(self, max_entries: int, max_bytes: int, max_text_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_text_bytes = max_text_bytes
        self._entries: OrderedDict[tuple[int, str], bytes] = OrderedDict()
        self.memory_bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str, namespace: int = 0) -> array[int] | None:
        """A private copy of the cached ids (callers may keep or change it), or None."""
        key = (namespace, text)
        # Too long to have been cached: skip hashing it.
        packed = self._entries.get(key) if len(text) <= self.max_text_bytes else None
        if packed is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return array("I", packed)

    def put(self, text: str, ids: array[int], namespace: int = 0) -> None:
        key = (namespace, text)
        if not self.cacheable(text) or key in self._entries:
            return
        packed = ids.tobytes()
        size = entry_bytes(text, packed)
        if size > self.max_bytes:
            return
        self._entries[key] = packed
        self.memory_bytes += size
        while len(self._entries) > self.max_entries or self.memory_bytes > self.max_bytes:
            (_, old_text), old_packed = self._entries.popitem(last=False)
            self.memory_bytes -= entry_bytes(old_text, old_packed)

    def cacheable(self, text: str) -> bool:
        # UTF-8 takes at least one byte per character: skip the encode when length decides.
        if len(text) > self.max_text_bytes:
            return False
        return len(text) * 4 <= self.max_text_bytes or (
            len(text.encode("utf-8")) <= self.max_text_bytes
        )


def entry_bytes(text: str, packed_ids: bytes) -> int:
    return sys.getsizeof(text) + sys.getsizeof(packed_ids) + ENTRY_OVERHEAD_BYTES
