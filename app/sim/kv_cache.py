"""A prefix KV cache in the manner of vLLM's automatic prefix caching, without the tensors.

The GPU's KV memory is `num_blocks` blocks of `block_size` tokens. A full block of prompt
tokens is identified by a chained hash: block i's hash covers block i-1's hash and its own
tokens, so a block can only be reused behind the very same prefix. A running sequence holds its
blocks; when it finishes, its hashed blocks stay cached but become free for reuse, and the
least recently freed is evicted first. Usage counts held blocks only, as vLLM's
`kv_cache_usage_perc` does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def chained_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block; a partial last block is never cached."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        # Tuple hashes of ints are not salted, so they agree across processes.
        previous = hash((previous, *tokens[start : start + block_size]))
        hashes.append(previous)
    return hashes


@dataclass(frozen=True)
class KVAllocation:
    block_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class PrefixKVCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_by_hash: dict[int, int] = {}
        # Blocks nobody holds, next victim first. Hashed ones still serve prefix hits.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.query_tokens = 0
        self.hit_tokens = 0

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    def allocate(self, prompt: Sequence[int], output_tokens: int) -> KVAllocation:
        """Hold blocks for a sequence's prompt and output, reusing its cached prefix.

        When memory is short the sequence gets what is free and the rest is simply not
        cached: the sim models time, and a sequence never waits for KV space.
        """
        hashes = chained_block_hashes(prompt, self.block_size)
        # vLLM recomputes at least the last prompt token to get logits, so a prompt made
        # only of cached blocks still leaves its final block to compute.
        hit_blocks = self._cached_prefix_blocks(
            hashes[: max(len(prompt) - 1, 0) // self.block_size]
        )
        for block in hit_blocks:
            self._hold(block)
        held = list(hit_blocks)
        needed = -(-(len(prompt) + output_tokens) // self.block_size)
        for block_hash in hashes[len(hit_blocks) :]:
            shared = self._block_by_hash.get(block_hash)
            if shared is not None:
                self._hold(shared)
                held.append(shared)
                continue
            fresh = self._take_free_block()
            if fresh is None:
                break
            self._block_hash[fresh] = block_hash
            self._block_by_hash[block_hash] = fresh
            held.append(fresh)
        while len(held) < needed:
            spare = self._take_free_block()
            if spare is None:
                break
            held.append(spare)

        cached_tokens = len(hit_blocks) * self.block_size
        self.query_tokens += len(prompt)
        self.hit_tokens += cached_tokens
        return KVAllocation(tuple(held), len(prompt), cached_tokens)

    def release(self, allocation: KVAllocation) -> None:
        # Freed in reverse so a prefix's tail is evicted before its head, which keeps the
        # surviving part of a prefix usable (a head-less tail can never hit).
        for block in reversed(allocation.block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] > 0:
                continue
            self._free[block] = None
            if self._block_hash[block] is None:
                self._free.move_to_end(block, last=False)

    def evict_all(self) -> int:
        """Forget every cached block nobody holds; returns how many were dropped."""
        evicted = 0
        for block in self._free:
            block_hash = self._block_hash[block]
            if block_hash is not None:
                del self._block_by_hash[block_hash]
                self._block_hash[block] = None
                evicted += 1
        return evicted

    def _cached_prefix_blocks(self, hashes: list[int]) -> list[int]:
        blocks: list[int] = []
        for block_hash in hashes:
            block = self._block_by_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _hold(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def _take_free_block(self) -> int | None:
        if not self._free:
            return None
        block, _ = self._free.popitem(last=False)
        evicted = self._block_hash[block]
        if evicted is not None:
            del self._block_by_hash[evicted]
            self._block_hash[block] = None
        self._ref_counts[block] = 1
        return block
