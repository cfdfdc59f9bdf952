"""A prefix KV cache in the manner of vLLM's automatic prefix caching, without the tensors.

The GPU's KV memory is `num_blocks` blocks of `block_size` tokens. A full block of prompt
tokens is identified by a chained hash: block i's hash covers block i-1's hash and its own
tokens, so a block can only be reused behind the very same prefix. A running sequence holds its
blocks; when it finishes, its hashed blocks stay cached but become free for reuse, and the
least recently freed is evicted first. A sequence under a LoRA adapter starts its chain from
the adapter's name (vLLM puts the name in each block's extra keys), so the same tokens under
another adapter, or under none, never share a block. Usage counts held blocks only, as vLLM's
`kv_cache_usage_perc` does.

Given `on_events`, the cache tells what it stores and evicts as vLLM's KV events do
(`BlockStored` for each run of newly cached blocks, chained to its parent, `BlockRemoved` for
each cached block reused, `AllBlocksCleared` when emptied), once per allocation or eviction:
the simulated backend publishes them (`kv_publisher.py`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.errors import require_at_least
from app.kv_events.wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

FULL_ATTENTION_GROUP = 0


def external_hash(block_hash: int) -> bytes:
    """A block hash as vLLM publishes it by default: bytes (here the 8 of a Python hash)."""
    return block_hash.to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class LoraTag:
    """The LoRA adapter a sequence runs under, as its KV blocks are keyed and told."""

    name: str
    lora_int_id: int

    @property
    def chain_seed(self) -> int:
        # A digest, not hash(): string hashes are salted per process.
        return int.from_bytes(hashlib.blake2b(self.name.encode(), digest_size=8).digest(), "big")


def chained_block_hashes(tokens: Sequence[int], block_size: int, seed: int = 0) -> list[int]:
    """One hash per full block; a partial last block is never cached."""
    hashes: list[int] = []
    previous = seed
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
        require_at_least(1, num_blocks=num_blocks, block_size=block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_by_hash: dict[int, int] = {}
        # Blocks nobody holds, next victim first. Hashed ones still serve prefix hits.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.query_tokens = 0
        self.hit_tokens = 0
        self.on_events: Callable[[list[KVEvent]], None] | None = None
        self._events: list[KVEvent] = []

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    def allocate(
        self, prompt: Sequence[int], output_tokens: int, lora: LoraTag | None = None
    ) -> KVAllocation:
        """Hold blocks for a sequence's prompt and output, reusing its cached prefix.

        When memory is short the sequence gets what is free and the rest is simply not
        cached: the sim models time, and a sequence never waits for KV space.
        """
        hashes = chained_block_hashes(prompt, self.block_size, lora.chain_seed if lora else 0)
        # vLLM recomputes at least the last prompt token to get logits, so a prompt made
        # only of cached blocks still leaves its final block to compute.
        hit_blocks = self._cached_prefix_blocks(
            hashes[: max(len(prompt) - 1, 0) // self.block_size]
        )
        for block in hit_blocks:
            self._hold(block)
        held = list(hit_blocks)
        needed = -(-(len(prompt) + output_tokens) // self.block_size)
        run_start = len(held)  # the first of the blocks cached by this call, not yet told
        for position in range(len(hit_blocks), len(hashes)):
            block_hash = hashes[position]
            shared = self._block_by_hash.get(block_hash)
            if shared is not None:
                self._stored(prompt, hashes, run_start, position, lora)
                run_start = position + 1
                self._hold(shared)
                held.append(shared)
                continue
            fresh = self._take_free_block()
            if fresh is None:
                break
            self._block_hash[fresh] = block_hash
            self._block_by_hash[block_hash] = fresh
            held.append(fresh)
        self._stored(prompt, hashes, run_start, len(held), lora)
        while len(held) < needed:
            spare = self._take_free_block()
            if spare is None:
                break
            held.append(spare)

        cached_tokens = len(hit_blocks) * self.block_size
        self.query_tokens += len(prompt)
        self.hit_tokens += cached_tokens
        self._tell()
        return KVAllocation(tuple(held), len(prompt), cached_tokens)

    def _stored(
        self,
        prompt: Sequence[int],
        hashes: list[int],
        start: int,
        end: int,
        lora: LoraTag | None,
    ) -> None:
        """Blocks start..end-1 of this prompt were cached just now."""
        if self.on_events is None or start >= end:
            return
        size = self.block_size
        extra = None if lora is None else (lora.name,)
        self._events.append(
            BlockStored(
                tuple(external_hash(h) for h in hashes[start:end]),
                external_hash(hashes[start - 1]) if start else None,
                tuple(prompt[start * size : end * size]),
                size,
                lora_id=None if lora is None else lora.lora_int_id,
                medium=MEDIUM_GPU,
                lora_name=None if lora is None else lora.name,
                extra_keys=(extra,) * (end - start),
                group_idx=FULL_ATTENTION_GROUP,
                kv_cache_spec_kind="full_attention",
            )
        )

    def _tell(self) -> None:
        if self.on_events is not None and self._events:
            events, self._events = self._events, []
            self.on_events(events)

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
        """Forget every cached block nobody holds; returns how many were dropped.

        Told as `AllBlocksCleared` when that empties the cache (no sequence holds a block,
        as vLLM's prefix-cache reset requires), else block by block."""
        evicted: list[int] = []
        for block in self._free:
            block_hash = self._block_hash[block]
            if block_hash is not None:
                del self._block_by_hash[block_hash]
                self._block_hash[block] = None
                evicted.append(block_hash)
        if self.on_events is not None:
            if len(self._free) == self.num_blocks:
                self._events.append(AllBlocksCleared())
            else:
                self._events.extend(self._removed(h) for h in evicted)
            self._tell()
        return len(evicted)

    def _removed(self, block_hash: int) -> BlockRemoved:
        return BlockRemoved((external_hash(block_hash),), MEDIUM_GPU, FULL_ATTENTION_GROUP)

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
            if self.on_events is not None:
                self._events.append(self._removed(evicted))
        self._ref_counts[block] = 1
        return block
