"""Where work that would hold the loop runs: offloaded, else bounded, else the policy's.

One dispatcher per kind of work: tokenizer jobs offloaded to worker threads (the job calls
`encode_batch_fast`, which releases the GIL; `Tokenizer.encode` holds it for the whole call,
so offloading that would still freeze the loop, tests/test_preprocess_threads.py), and
request renders (JSON parse, shape checks, Jinja2) offloaded to worker processes, since
pure Python holds the GIL in any thread (workers.py). For each:

1. An offloaded worker, under `CapacityLimiter(workers)`. Up to `queue_limit` jobs may wait
   for one.
2. When that queue is full: the capacity-one fallback, the job run inline on the event loop —
   at most one at a time, and only a job its caller says is small (`inline_ok`): the fallback
   bounds what cannot be offloaded, and a 4k-token encode on the loop is a stall however
   rarely it runs (seen: 109-136 ms worst /health under bursts of 20 such prompts). The
   permit is held across one checkpoint after the job, so between two inline jobs the loop
   polls I/O and runs every ready task: one short stall per loop turn at worst.
3. When the permit is taken too, or the job is too big for it, the saturation policy, read
   per request (switchable at runtime): `wait` races a worker slot against the permit (a big
   job waits for a worker only) and takes whichever frees first; `bail-out` returns None at
   once and the request goes on without tokens.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Literal, Protocol, TypeVar

import trio
from prometheus_client import Counter, Gauge

from app.config import Saturation

T = TypeVar("T")
Where = Literal["offloaded", "fallback"]
Phase = Callable[[str], AbstractContextManager[None]]

SATURATION_POLICIES: tuple[Saturation, ...] = ("wait", "bail-out")


class Offload(Protocol):
    """Runs a job away from the event loop (a thread, a process) and returns its result."""

    def __call__(self, job: Callable[[], T]) -> Awaitable[T]: ...


class Dispatcher:
    def __init__(
        self,
        offload: Offload,
        *,
        workers: int,
        queue_limit: int,
        saturation: Saturation,
        phase: Phase,
        fallback_phase: str,
        queue_depth: Gauge,
        saturated: Counter,
    ) -> None:
        self._offload = offload
        # Slots are taken by hand (so that one can be raced against the fallback permit);
        # the offload itself must not queue behind another limiter.
        self._workers = trio.CapacityLimiter(workers)
        self._fallback = trio.Semaphore(1)
        self.queue_limit = queue_limit
        self.saturation = saturation
        self._phase = phase
        self._fallback_phase = fallback_phase
        self._queue_depth = queue_depth
        self._saturated = saturated
        self.queued = 0  # waiting for a worker in the queue
        self.saturated_waiting = 0  # saturated, racing for a worker or the permit
        self._peaks = self._occupancy()

    @property
    def saturation(self) -> Saturation:
        return self._saturation

    @saturation.setter
    def saturation(self, policy: Saturation) -> None:
        if policy not in SATURATION_POLICIES:
            raise ValueError(f"saturation must be one of {SATURATION_POLICIES}, not {policy!r}")
        self._saturation = policy

    @property
    def workers(self) -> int:
        return int(self._workers.total_tokens)

    @property
    def workers_busy(self) -> int:
        return int(self._workers.total_tokens - self._workers.available_tokens)

    @property
    def fallback_busy(self) -> bool:
        return self._fallback.value == 0

    def take_peaks(self) -> dict[str, int]:
        """The most workers busy, requests queued and saturated, and whether the fallback
        ran, since the last call: what a once-a-second sample would miss of a short burst."""
        peaks, self._peaks = self._peaks, self._occupancy()
        return peaks

    def _occupancy(self) -> dict[str, int]:
        return {
            "busy": self.workers_busy,
            "queued": self.queued,
            "saturated_waiting": self.saturated_waiting,
            "fallback_busy": int(self.fallback_busy),
        }

    def _note_peaks(self) -> None:
        for name, value in self._occupancy().items():
            if value > self._peaks[name]:
                self._peaks[name] = value

    async def run(
        self, job: Callable[[], T], *, inline_ok: bool = True, may_bail: bool = True
    ) -> tuple[T, Where] | None:
        """The job's result and where it ran, or None when bailing out. `inline_ok`: the job
        is small enough to run on the loop as the fallback; `may_bail`: the request can go
        on without the job's result (when not, it waits whatever the policy)."""
        if self._workers.available_tokens > 0 or self.queued < self.queue_limit:
            return await self._queue_for_worker(job)
        if inline_ok:
            try:
                self._fallback.acquire_nowait()
            except trio.WouldBlock:
                pass
            else:
                return await self._inline(job)
        if self.saturation == "bail-out" and may_bail:
            self._saturated.labels(outcome="bailed_out").inc()
            return None
        self._saturated.labels(outcome="waited").inc()
        if not inline_ok:
            return await self._wait_for_worker(job)
        return await self._race(job)

    async def _wait_for_worker(self, job: Callable[[], T]) -> tuple[T, Where]:
        borrower = object()
        self._waiting(saturated=+1)
        try:
            await self._workers.acquire_on_behalf_of(borrower)
        finally:
            self._waiting(saturated=-1)
        self._note_peaks()
        return await self._offloaded(job, borrower)

    async def _queue_for_worker(self, job: Callable[[], T]) -> tuple[T, Where]:
        borrower = object()
        waits = self._workers.available_tokens == 0
        self._waiting(queued=+1 if waits else 0)
        try:
            await self._workers.acquire_on_behalf_of(borrower)
        finally:
            self._waiting(queued=-1 if waits else 0)
        self._note_peaks()
        return await self._offloaded(job, borrower)

    async def _offloaded(self, job: Callable[[], T], borrower: object) -> tuple[T, Where]:
        try:
            result = await self._offload(job)
        finally:
            self._workers.release_on_behalf_of(borrower)
        return result, "offloaded"

    async def _inline(self, job: Callable[[], T]) -> tuple[T, Where]:
        """Run the job on the loop; the caller holds the fallback permit."""
        self._note_peaks()
        try:
            with self._phase(self._fallback_phase):
                result = job()
            await trio.lowlevel.checkpoint()
        finally:
            self._fallback.release()
        return result, "fallback"

    async def _race(self, job: Callable[[], T]) -> tuple[T, Where]:
        borrower = object()
        won: list[Where] = []

        async def take_worker(cancel: trio.CancelScope) -> None:
            await self._workers.acquire_on_behalf_of(borrower)
            if won:  # the permit won in the same scheduling batch
                self._workers.release_on_behalf_of(borrower)
                return
            won.append("offloaded")
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
                nursery.start_soon(take_worker, nursery.cancel_scope)
                nursery.start_soon(take_permit, nursery.cancel_scope)
        except BaseException:
            # Cancelled from outside after winning: give back what was won.
            if won == ["offloaded"]:
                self._workers.release_on_behalf_of(borrower)
            elif won == ["fallback"]:
                self._fallback.release()
            raise
        finally:
            self._waiting(saturated=-1)
        if won == ["offloaded"]:
            self._note_peaks()
            return await self._offloaded(job, borrower)
        return await self._inline(job)

    def _waiting(self, queued: int = 0, saturated: int = 0) -> None:
        self.queued += queued
        self.saturated_waiting += saturated
        self._queue_depth.set(self.queued + self.saturated_waiting)
        self._note_peaks()
