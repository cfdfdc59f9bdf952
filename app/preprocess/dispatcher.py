"""Where a cache miss is tokenized: the layered defence of seed 000, on Trio.

1. A worker thread, under `CapacityLimiter(tokenize_threads)`. The job must call a
   GIL-releasing method (`encode_batch_fast`): `Tokenizer.encode` holds the GIL for the whole
   call, so offloading it would still freeze the loop (tests/test_preprocess_gil.py).
   Up to `tokenize_queue` requests may wait for a thread.
2. When that queue is full: the capacity-one fallback, the job run inline on the event loop —
   at most one at a time. The permit is held across one checkpoint after the job, so between
   two inline jobs the loop polls I/O and runs every ready task: one stall per loop turn at
   worst, never a train of them.
3. When the permit is taken too, the saturation policy, read per request (switchable at
   runtime): `wait` races a thread slot against the permit and takes whichever frees first;
   `bail-out` returns None at once and the request goes on without tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Generic, Literal, TypeVar

import trio

from app.config import Saturation
from app.observe.metrics import Metrics

T = TypeVar("T")
Where = Literal["thread", "fallback"]
Phase = Callable[[str], AbstractContextManager[None]]

SATURATION_POLICIES: tuple[Saturation, ...] = ("wait", "bail-out")


class Dispatcher(Generic[T]):
    def __init__(
        self,
        job: Callable[[str], T],
        *,
        threads: int,
        queue_limit: int,
        saturation: Saturation,
        metrics: Metrics,
        phase: Phase,
    ) -> None:
        self._job = job
        self._threads = trio.CapacityLimiter(threads)
        # The slot is taken from _threads by hand (so it can be raced); to_thread itself must
        # not queue on Trio's default limiter of 40 as well.
        self._unlimited = trio.CapacityLimiter(math.inf)
        self._fallback = trio.Semaphore(1)
        self.queue_limit = queue_limit
        self.saturation = saturation
        self._metrics = metrics
        self._phase = phase
        self.queued = 0  # waiting for a thread in the queue
        self.saturated_waiting = 0  # saturated, racing for a thread or the permit

    @property
    def saturation(self) -> Saturation:
        return self._saturation

    @saturation.setter
    def saturation(self, policy: Saturation) -> None:
        if policy not in SATURATION_POLICIES:
            raise ValueError(f"saturation must be one of {SATURATION_POLICIES}, not {policy!r}")
        self._saturation = policy

    @property
    def threads_busy(self) -> int:
        return int(self._threads.total_tokens - self._threads.available_tokens)

    @property
    def fallback_busy(self) -> bool:
        return self._fallback.value == 0

    async def run(self, text: str) -> tuple[T, Where] | None:
        """The job's result and where it ran, or None when bailing out."""
        if self._threads.available_tokens > 0 or self.queued < self.queue_limit:
            return await self._queue_for_thread(text)
        try:
            self._fallback.acquire_nowait()
        except trio.WouldBlock:
            pass
        else:
            return await self._inline(text)
        if self.saturation == "bail-out":
            self._metrics.tokenize_saturated.labels(outcome="bailed_out").inc()
            return None
        self._metrics.tokenize_saturated.labels(outcome="waited").inc()
        return await self._race(text)

    async def _queue_for_thread(self, text: str) -> tuple[T, Where]:
        borrower = object()
        waits = self._threads.available_tokens == 0
        self._waiting(queued=+1 if waits else 0)
        try:
            await self._threads.acquire_on_behalf_of(borrower)
        finally:
            self._waiting(queued=-1 if waits else 0)
        return await self._in_thread(text, borrower)

    async def _in_thread(self, text: str, borrower: object) -> tuple[T, Where]:
        try:
            result = await trio.to_thread.run_sync(self._job, text, limiter=self._unlimited)
        finally:
            self._threads.release_on_behalf_of(borrower)
        return result, "thread"

    async def _inline(self, text: str) -> tuple[T, Where]:
        """Run the job on the loop; the caller holds the fallback permit."""
        try:
            with self._phase("tokenize-fallback"):
                result = self._job(text)
            await trio.lowlevel.checkpoint()
        finally:
            self._fallback.release()
        return result, "fallback"

    async def _race(self, text: str) -> tuple[T, Where]:
        borrower = object()
        won: list[Where] = []

        async def take_thread(cancel: trio.CancelScope) -> None:
            await self._threads.acquire_on_behalf_of(borrower)
            if won:  # the permit won in the same scheduling batch
                self._threads.release_on_behalf_of(borrower)
                return
            won.append("thread")
            cancel.cancel()

        async def take_permit(cancel: trio.CancelScope) -> None:
            await self._fallback.acquire()
            if won:
                self._fallback.release()
                return
            won.append("fallback")
            cancel.cancel()

        self._waiting(saturated=+1)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(take_thread, nursery.cancel_scope)
                nursery.start_soon(take_permit, nursery.cancel_scope)
        except BaseException:
            # Cancelled from outside after winning: give back what was won.
            if won == ["thread"]:
                self._threads.release_on_behalf_of(borrower)
            elif won == ["fallback"]:
                self._fallback.release()
            raise
        finally:
            self._waiting(saturated=-1)
        if won == ["thread"]:
            return await self._in_thread(text, borrower)
        return await self._inline(text)

    def _waiting(self, queued: int = 0, saturated: int = 0) -> None:
        self.queued += queued
        self.saturated_waiting += saturated
        self._metrics.tokenize_queue_depth.set(self.queued + self.saturated_waiting)
