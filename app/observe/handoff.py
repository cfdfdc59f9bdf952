"""Handing finished requests' records from the event loop to one worker thread, for work that
must never run on the loop: building and exporting trace spans (tracing.py), writing access
log lines (access_log.py).

`offer` is all the loop pays: a length check and a deque append (both atomic under the GIL,
so no lock). When the deque holds `capacity` items, `offer` refuses and the caller counts the
drop: a stuck consumer (a dead collector, a blocked stderr) costs the loop nothing and the
memory stays bounded. The worker wakes every `interval_s`, or at once when the deque is half
full, so a burst does not wait for the next tick; waking it on every offer would cost the loop
a lock and a notify per request.

The worker takes `batch` items at a time, so its GIL slices stay short between the consumer's
own I/O (each write or send lets the loop run). `drain` may also be called from another thread
(a flush): one lock makes drains take turns, and a drain that returns has handed over
everything offered before it began.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

from app.errors import require_at_least

log = logging.getLogger("sluice.observe")

T = TypeVar("T")
Consumer = Callable[[list[T]], None]


class Handoff(Generic[T]):
    def __init__(
        self, capacity: int, *, name: str, interval_s: float = 0.1, batch: int = 256
    ) -> None:
        require_at_least(1, capacity=capacity)
        self.capacity = capacity
        self.name = name
        self._interval_s = interval_s
        self._batch = batch
        self._items: deque[T] = deque()
        self._wake_at = capacity // 2
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._draining = threading.Lock()
        self._thread: threading.Thread | None = None

    def offer(self, item: T) -> bool:
        """Queue `item` for the worker; False (nothing queued) when the queue is full."""
        items = self._items
        held = len(items)
        if held >= self.capacity:
            return False
        items.append(item)
        if held == self._wake_at:
            self._wake.set()
        return True

    def __len__(self) -> int:
        return len(self._items)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drain(self, consume: Consumer[T]) -> None:
        """Hand every queued item to `consume`, `batch` at a time (blocking: a thread's)."""
        items = self._items
        with self._draining:
            while items:
                taken = [items.popleft() for _ in range(min(len(items), self._batch))]
                try:
                    consume(taken)
                except Exception:
                    # A bug in the consumer costs this batch, not the thread that carries
                    # every later one.
                    log.exception("%s: a batch of %d was lost", self.name, len(taken))

    def start(self, consume: Consumer[T]) -> None:
        """Start the worker thread: it drains until `stop`, then drains once more."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} was started already")
        # A daemon thread, so that a process that exits without stopping it (a crash, an
        # os._exit in a worker) is not held by it; `stop` joins it otherwise.
        self._thread = threading.Thread(
            target=self._work, args=(consume,), name=self.name, daemon=True
        )
        self._thread.start()

    def _work(self, consume: Consumer[T]) -> None:
        wake, stopping = self._wake, self._stopping
        while not stopping.is_set():
            wake.wait(self._interval_s)
            wake.clear()
            self.drain(consume)
        self.drain(consume)

    def stop(self, timeout_s: float) -> bool:
        """Stop the worker after a last drain; True if it ended within `timeout_s`
        (blocking: call it from a thread)."""
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    async def run(
        self,
        consume: Consumer[T],
        *,
        close: Callable[[float], None] | None = None,
        timeout_s: float = 5.0,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """For a nursery: start the worker, and when cancelled stop it and then `close`
        (given what is left of `timeout_s`), both in a thread. Shutdown is bounded: past
        `timeout_s` and a second of grace the threads are abandoned (daemon threads, they
        do not hold the process)."""
        self.start(consume)
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(timeout_s + 1.0):
                await trio.to_thread.run_sync(
                    self._shut_down, close, timeout_s, abandon_on_cancel=True
                )

    def _shut_down(self, close: Callable[[float], None] | None, timeout_s: float) -> None:
        ends = time.monotonic() + timeout_s
        if not self.stop(timeout_s):
            log.warning("%s: the worker did not stop within %.1fs", self.name, timeout_s)
        if close is not None:
            close(max(0.0, ends - time.monotonic()))
