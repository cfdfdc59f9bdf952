"""Where offloaded jobs run: worker threads for the tokenizer, worker processes for renders.

Threads suit the tokenizer because its job calls `encode_batch_fast`, which releases the GIL
while Rust works. They do not suit a request render: `json.loads` and Jinja2 hold the GIL (a
thread yields it only every switch interval, and not at all inside one C call), so a render
in a thread still holds the loop in slices; a process does not (app/README.md has the
figures). A small job costs more in a process than in a thread, so only renders estimated
over the loop's budget, and bodies too large to parse on the loop, come here.

Processes come from trio-parallel (the Trio-native pool): spawned, not forked, because this
process has threads (trio's cache, the tokenizer's) whose locks a fork would copy held.
They start on first need, one more whenever every started one is busy, up to the
dispatcher's bound (`--render-workers`, at most 4 by default: each is a ~60 MB interpreter);
one idle for `IDLE_S` stops, so the first large request after a quiet spell pays a worker's
boot (~0.2 s) rather than every start-up paying all of them. A cancelled job runs to its end
in the worker rather than killing it: renders are bounded, respawning is not cheap.

A worker ignores SIGINT and SIGTERM: a Ctrl-C or a `kill` of the process group reaches
every process in it, and the proxy ends its workers after their last job. If the proxy dies
outright, the worker's end of the pipe closes and it exits: no orphan stays.

Workers of both kinds run at a lower CPU priority (nice 10) than the event loop: a loop that
waits for a core answers late however free of the GIL it is, and its latency matters more
than the workers' throughput.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
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
# A render worker idle this long stops; the next large request starts one again.
IDLE_S = 300.0
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


def prepare_worker(warm_up: Callable[[], object]) -> bool:
    """Run by each render worker process as it starts."""
    os.nice(WORKER_NICENESS)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    warm_up()
    return True


class ProcessPool:
    """Worker processes for renders, open while `running()` is; `await pool(job)` runs one,
    in an idle worker or a new one (its caller bounds how many run at once). Outside
    `running()` (a Preprocessor used on its own, as in tests) jobs go to trio-parallel's
    default pool."""

    def __init__(self) -> None:
        self._context: trio_parallel.WorkerContext | None = None

    @asynccontextmanager
    async def running(self, warm_up: Callable[[], object]) -> AsyncIterator[None]:
        try:
            async with trio_parallel.open_worker_context(
                idle_timeout=IDLE_S,
                grace_period=WORKER_GRACE_SECONDS,
                init=functools.partial(prepare_worker, warm_up),
            ) as context:
                self._context = context
                try:
                    yield
                finally:
                    self._context = None
        except trio_parallel.BrokenWorkerError as exc:
            # A worker still busy WORKER_GRACE_SECONDS into the shutdown was killed: worth a
            # line, not worth failing the proxy's exit for.
            log.warning("a render worker process had to be killed at shutdown: %s", exc)

    async def __call__(self, job: Callable[[], T]) -> T:
        context = self._context
        result: T
        if context is None:
            result = await trio_parallel.run_sync(job)
        else:
            # No limiter of trio-parallel's: the dispatcher bounds the jobs, hence the workers.
            result = await context.run_sync(job, limiter=_UNLIMITED)
        return result
