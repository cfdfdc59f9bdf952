"""A wake-up for one waiting task, cheaper than a ParkingLot (grpc_server.py's calls and
writer wait on one for every message and every batch)."""

from __future__ import annotations

import trio


class Wakeup:
    """One task's wait for a wake-up, the task rescheduled directly: a call task waits for
    every message of a stream and the writer for every batch, so a ParkingLot's generality
    (many waiters, an ordered dict, a generator per unpark) costs on every message."""

    __slots__ = ("_task",)

    def __init__(self) -> None:
        self._task: trio.lowlevel.Task | None = None

    def wake(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        assert self._task is None, "one waiter at a time"
        self._task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
