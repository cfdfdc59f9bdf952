"""The simulated GPU at work: the pure models of `latency` and `kv_cache`, played out in time.

GPU time is `trio.sleep`, so a busy simulated GPU costs its host loop nothing. A sequence
that is cancelled anywhere (waiting, prefilling or decoding) gives back its batch slot and KV
blocks at once, which is how a client disconnect frees capacity.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence

import trio

from app.sim.kv_cache import PrefixKVCache
from app.sim.latency import BatchAdmission, LatencyModel
from app.sim.settings import SimSettings

EmitToken = Callable[[int], Awaitable[None]]


class SimEngine:
    def __init__(self, settings: SimSettings) -> None:
        self.latency = LatencyModel.from_settings(settings)
        self.kv_cache = PrefixKVCache(settings.kv_cache_blocks, settings.block_size)
        self.batch = BatchAdmission(settings.max_num_seqs)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._seq_ids = itertools.count()
        self._admitted: dict[int, trio.Event] = {}
        self._changed = trio.Event()

    @property
    def running(self) -> int:
        return self.batch.running

    @property
    def waiting(self) -> int:
        return self.batch.waiting

    async def generate(self, prompt: Sequence[int], output_tokens: int, emit: EmitToken) -> int:
        """Queue, prefill, then call `emit(i)` as output token i is produced.

        Returns how many prompt tokens the prefix cache served.
        """
        seq_id = next(self._seq_ids)
        try:
            if not self.batch.arrive(seq_id):
                admitted = self._admitted[seq_id] = trio.Event()
                self._notify()
                await admitted.wait()
            self._notify()
            allocation = self.kv_cache.allocate(prompt, output_tokens)
            try:
                self.prompt_tokens_total += len(prompt)
                await trio.sleep(self.latency.prefill_seconds(allocation.uncached_tokens))
                for index in range(output_tokens):
                    await trio.sleep(self.latency.token_gap_seconds(index))
                    self.generation_tokens_total += 1
                    await emit(index)
                return allocation.cached_tokens
            finally:
                self.kv_cache.release(allocation)
        finally:
            self._admitted.pop(seq_id, None)
            for next_id in self.batch.leave(seq_id):
                self._admitted.pop(next_id).set()
            self._notify()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Block until `condition()` holds; it is re-checked whenever a sequence moves."""
        while not condition():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
