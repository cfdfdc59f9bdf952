"""Admission: a bounded wait for a free backend, and the 429 a request gets instead.

`SlotQueue` is where requests wait when every backend of their model's pool already has
`--max-inflight-per-backend` requests (one queue per pool, so that a full pool never holds up
another's requests): at most `max_waiting` of them, each for at most `timeout` seconds, first
come first served; beyond either, the request is refused (429) instead of being held in memory.
"""

from __future__ import annotations

import math
from collections import deque

import trio

from app.http.errors import ClientError


class Overloaded(ClientError):
    """Refused for now: 429 with Retry-After (whole seconds, at least one)."""

    def __init__(self, reason: str, message: str, retry_after: float) -> None:
        retry = str(max(1, math.ceil(retry_after))).encode()
        super().__init__(
            message,
            code=reason,
            status=429,
            type_="rate_limit_error",
            headers=[(b"retry-after", retry)],
        )
        self.reason = reason  # tokens_per_minute | request_too_large | queue_full | queue_timeout
        self.retry_after = retry_after


class SlotQueue:
    def __init__(self, max_waiting: int, timeout: float) -> None:
        self.max_waiting = max_waiting
        self.timeout = timeout
        self._waiters: deque[trio.Event] = deque()
        self.rejected_full = 0
        self.rejected_timeout = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def wait(self, deadline: float, poll: float) -> None:
        """Wait until woken, `poll` seconds pass (the caller re-checks), or `deadline`.

        Raises `Overloaded` when the queue is full or the deadline passed.
        """
        now = trio.current_time()
        if now >= deadline:
            self.rejected_timeout += 1
            raise Overloaded(
                "queue_timeout",
                f"Every backend stayed at its in-flight limit for {self.timeout:g}s; "
                "try again later.",
                1.0,
            )
        if len(self._waiters) >= self.max_waiting:
            self.rejected_full += 1
            raise Overloaded(
                "queue_full",
                "Every backend is at its in-flight limit and the wait queue is full; "
                "try again later.",
                1.0,
            )
        woken = trio.Event()
        self._waiters.append(woken)
        try:
            with trio.move_on_at(min(deadline, now + poll)):
                await woken.wait()
        finally:
            if not woken.is_set():
                self._waiters.remove(woken)

    def wake_one(self) -> None:
        if self._waiters:
            self._waiters.popleft().set()
