"""Where offloaded jobs run: worker threads for the tokenizer, worker processes for renders.

Threads suit the tokenizer because its job calls `encode_batch_fast`, which releases the GIL
while Rust works. They do not suit a request render: `json.loads` and Jinja2 hold the GIL (a
thread yields it only every switch interval, 5 ms, and not at all inside one C call), so a
render in a thread still holds the loop in slices. Measured here (3 clients rendering
1,500-4,000-message conversations, a 1 ms ticker on the loop): inline 129-144 ms worst gap,
thread 7.2-7.3 ms, process 3.5 ms; a 12 MB body parsed inline held the loop 210 ms, in a
worker process the worst gap was 4-19 ms (the result crossing the pipe). Small jobs cost more
in a process (0.30 ms a round trip against 0.15 ms for a thread), which is why only renders
estimated over the loop's budget, and bodies too large to parse on the loop, come here.

Processes come from trio-parallel (the Trio-native pool): spawned, not forked, because this
process has threads (trio's cache, the tokenizer's) whose locks a fork would copy held;
started all at once when the proxy starts, so that no request waits for an interpreter to
boot; kept for the life of the proxy. A job that is cancelled (the client went away) runs to
its end in the worker rather than killing it: renders are bounded, respawning is not cheap.

Workers of both kinds run at a lower CPU priority (nice 10) than the event loop: offloading
frees the loop from the GIL, but on a busy machine the loop still competes with them for a
core, and a loop that waits for the CPU answers late all the same. The loop's latency matters
more than the workers' throughput, so the kernel is told.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import trio
import trio_parallel

T = TypeVar("T")
log = logging.getLogger("sluice.preprocess")

# How long the proxy's shutdown waits for a busy worker before killing it.
WORKER_GRACE_SECONDS = 5.0
# Added to the workers' nice value: CFS then gives a runnable loop ~10x their share of a core.
WORKER_NICENESS = 10

# The dispatcher bounds the threads; Trio's default limiter (40) must not bound them too.
_UNLIMITED = trio.CapacityLimiter(math.inf)
_thread_state = threading.local()


async def in_thread(job: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(_lowered, job, limiter=_UNLIMITED)


def _lowered(job: Callable[[], T]) -> T:
    if not getattr(_thread_state, "lowered", False):
        # Trio reuses its threads, so each is lowered once; Linux nices threads one by one.
        thread = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, thread) + WORKER_NICENESS
        os.setpriority(os.PRIO_PROCESS, thread, min(niceness, 19))
        _thread_state.lowered = True
    return job()


def lower_priority() -> bool:
    """Run by each render worker process as it starts."""
    os.nice(WORKER_NICENESS)
    return True


class ProcessPool:
    """Worker processes for renders, open while `running()` is; `await pool(job)` runs one.

    The workers boot in the background (~0.15 s of imports each) while the proxy starts
    listening; a job that arrives before they are up waits for them rather than spawning
    more. Outside `running()` (a Preprocessor used on its own, as in tests) jobs go to
    trio-parallel's default pool, whose workers start on first use.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._context: trio_parallel.WorkerContext | None = None
        self._booted = trio.Event()

    @asynccontextmanager
    async def running(self, warm_up: Callable[[], object]) -> AsyncIterator[None]:
        try:
            async with trio_parallel.open_worker_context(
                idle_timeout=math.inf, grace_period=WORKER_GRACE_SECONDS, init=lower_priority
            ) as context:
                self._context, self._booted = context, trio.Event()
                try:
                    async with trio.open_nursery() as booting:
                        booting.start_soon(self._boot, context, warm_up)
                        yield
                        booting.cancel_scope.cancel()  # still booting at shutdown: kill them
                finally:
                    self._context = None
        except trio_parallel.BrokenWorkerError as exc:
            # Shutting down: a worker that did not stop in time was killed. Not worth failing
            # the proxy's exit for.
            log.warning("a render worker process had to be killed at shutdown: %s", exc)

    async def _boot(
        self, context: trio_parallel.WorkerContext, warm_up: Callable[[], object]
    ) -> None:
        # Concurrent jobs on an empty cache spawn one worker each.
        async with trio.open_nursery() as nursery:
            for _ in range(self.workers):
                nursery.start_soon(
                    functools.partial(context.run_sync, warm_up, kill_on_cancel=True)
                )
        self._booted.set()

    async def __call__(self, job: Callable[[], T]) -> T:
        if self._context is None:
            result: T = await trio_parallel.run_sync(job)
            return result
        await self._booted.wait()
        result = await self._context.run_sync(job)
        return result
