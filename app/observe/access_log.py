"""`--access-log json`: one JSON object per finished request, one line each, on stderr.

The loop only appends the record to a bounded queue (handoff.py); a worker thread encodes
and writes the lines, many to a write. A stderr that blocks (a full pipe, a stopped reader)
then stalls the worker and never the loop: the queue fills, and later records are dropped
and counted, as records that could not be encoded or written are.

A record is what the caller makes it (the request log's record and its trace id, say): it
must not change once written, since it is encoded later on another thread. Values that JSON
has no type for are written as their `str`.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import trio

from app.observe.handoff import Handoff

log = logging.getLogger("sluice.observe")

_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode


class AccessLog:
    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        max_queued: int = 4096,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        """`stream`: where the lines go (stderr when None, as it is when the worker writes)."""
        self._stream = stream
        self._shutdown_timeout_s = shutdown_timeout_s
        self._queue: Handoff[Mapping[str, Any]] = Handoff(max_queued, name="sluice-access-log")
        self._dropped = 0  # the loop writes it
        self._written = 0  # the worker writes these two
        self._failed = 0

    def write(self, record: Mapping[str, Any]) -> None:
        """Queue a finished request's record (on the loop: O(1), no I/O)."""
        if not self._queue.offer(record):
            self._dropped += 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write until cancelled, then write what is left (bounded by the shutdown timeout)."""
        await self._queue.run(
            self._write_lines, timeout_s=self._shutdown_timeout_s, task_status=task_status
        )

    async def flush(self) -> None:
        """Write everything queued so far, now (in a thread)."""
        await trio.to_thread.run_sync(self._queue.drain, self._write_lines)

    def _write_lines(self, records: list[Mapping[str, Any]]) -> None:
        lines = []
        for record in records:
            try:
                lines.append(_encode(record))
            except (TypeError, ValueError):  # a circular record, a key JSON refuses
                self._failed += 1
        if not lines:
            return
        stream = self._stream or sys.stderr
        try:
            stream.write("\n".join(lines) + "\n")
            stream.flush()
        except (OSError, ValueError) as exc:  # a closed or broken stderr
            if not self._failed:
                log.warning("the access log could not be written: %s", exc)
            self._failed += len(lines)
            return
        self._written += len(lines)

    def counters(self) -> dict[str, int]:
        """Lines written; records dropped (the queue was full) and failed (not encoded or
        not written)."""
        return {"written": self._written, "dropped": self._dropped, "failed": self._failed}

    def pending(self) -> int:
        """Records waiting for the worker: at most `max_queued`."""
        return len(self._queue)
