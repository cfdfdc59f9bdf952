"""The supervisor's dashboard: every worker's snapshot polled, merged and shown as one.

Once a tick each listening worker's private dashboard is asked for its `/api/snapshot`
(concurrently, each with a timeout: a stuck worker costs its own row, not the page). The
page's snapshot is their merge (`worker_snapshots.merge_snapshots`) with the request logs
interleaved, the saturation policy in force, a `workers` block (one row per worker: its
process, state, restarts and last exit, requests, loop lag, stalls) and `notices` for what an
operator should see at once (a worker restarted or down, the workers' own warnings).

The saturation switch reaches every worker at once: `set_saturation` writes the policy to all
of them concurrently and answers when they have taken it; a worker that missed it (starting,
or slow) gets it at its next poll, and a restarted one starts with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol, cast
from urllib.parse import urlencode

import trio

from app.budgets.sync import Notice
from app.config import Saturation
from app.dashboard.snapshot import Snapshot, WorkerRow
from app.dashboard.worker_snapshots import RecordLog, merge_snapshots
from app.errors import UpstreamError
from app.http.fetch import Fetcher
from app.observe.request_trace import RequestsSnapshot
from app.observe.worker_metrics import merge_worker_metrics
from app.preprocess.pipeline import PreprocessSnapshot

log = logging.getLogger("sluice.dashboard")

POLL_TIMEOUT_S = 2.0
# A restart stays on the page's notices this long.
NOTICE_S = 300.0


class WorkerState(Protocol):
    """One worker slot as the supervisor keeps it (app/cli/supervisor.py) and this page reads
    it; each start is a new incarnation. Times are the wall clock's."""

    index: int
    state: str  # starting | up | restarting | stopped
    incarnation: int
    pid: int | None
    dashboard_url: str | None
    started_at: float
    restarts: int
    last_exit: str | None
    last_exit_at: float | None
    restart_at: float | None


class WorkersView:
    def __init__(
        self,
        workers: Sequence[WorkerState],
        client: Fetcher,
        token: str,
        saturation: Saturation,
        *,
        tick_s: float = 1.0,
    ) -> None:
        self.workers = workers
        self.client = client
        self.tick_s = tick_s
        self.saturation = saturation
        self._headers = [(b"authorization", f"Bearer {token}".encode())]
        self._records = RecordLog()
        # By worker: (incarnation, its latest snapshot, when it was read (monotonic)).
        self._latest: dict[int, tuple[int, Snapshot, float]] = {}
        self._rates: dict[int, float | None] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            async with trio.open_nursery() as nursery:
                for worker in self.workers:
                    if worker.state == "up" and worker.dashboard_url:
                        nursery.start_soon(self._poll, worker)
            await trio.sleep(self.tick_s)

    async def _poll(self, worker: WorkerState) -> None:
        url, incarnation = worker.dashboard_url, worker.incarnation
        if url is None:
            return
        query = urlencode(
            {"counters": 1, "records_after": self._records.taken(worker.index, incarnation)}
        )
        try:
            with trio.fail_after(POLL_TIMEOUT_S):
                response = await self.client.get(url, f"/api/snapshot?{query}", self._headers)
            # A worker's, `?counters=1`.
            snapshot: Snapshot | None = response.json() if response.ok else None
        except (UpstreamError, ValueError, trio.TooSlowError) as exc:
            log.debug("worker %d: no snapshot (%s)", worker.index, exc)
            return
        if snapshot is None:
            log.debug("worker %d: no snapshot (it answered %d)", worker.index, response.status)
            return
        if incarnation != worker.incarnation:
            return  # it died meanwhile
        now = time.monotonic()
        self._rates[worker.index] = self._rate(worker.index, incarnation, snapshot, now)
        previous = self._latest.get(worker.index)
        if previous is not None and previous[0] != incarnation:
            self._records.forget(worker.index, previous[0])
        self._latest[worker.index] = (incarnation, snapshot, now)
        recent = snapshot.get("requests", {}).get("recent", [])
        self._records.update(worker.index, incarnation, recent)
        if snapshot.get("preprocess", {}).get("saturation") not in (None, self.saturation):
            await self._put_policy(worker, self.saturation)

    def _rate(self, index: int, incarnation: int, snapshot: Snapshot, now: float) -> float | None:
        previous = self._latest.get(index)
        if previous is None or previous[0] != incarnation or now <= previous[2]:
            return None
        before = float(previous[1].get("requests", {}).get("total", 0))
        after = float(snapshot.get("requests", {}).get("total", 0))
        return max(after - before, 0.0) / (now - previous[2])

    async def set_saturation(self, policy: Saturation) -> None:
        """Every listening worker takes `policy`; returns once each has answered (or failed,
        then its next poll tries again)."""
        log.info("saturation policy is now %s (every worker)", policy)
        self.saturation = policy
        async with trio.open_nursery() as nursery:
            for worker in self.workers:
                if worker.state == "up" and worker.dashboard_url:
                    nursery.start_soon(self._put_policy, worker, policy)

    async def _put_policy(self, worker: WorkerState, policy: Saturation) -> None:
        url = worker.dashboard_url
        if url is None:
            return
        try:
            with trio.fail_after(POLL_TIMEOUT_S):
                payload = {"saturation": policy}
                response = await self.client.put_json(url, "/api/policy", payload, self._headers)
        except (UpstreamError, trio.TooSlowError) as exc:
            log.warning("worker %d did not take the policy yet (%s)", worker.index, exc)
            return
        if not response.ok:
            log.warning("worker %d did not take the policy yet (%d)", worker.index, response.status)

    async def metrics_text(self) -> bytes:
        texts: dict[int, str] = {}

        async def read(worker: WorkerState) -> None:
            url = worker.dashboard_url
            if url is None:
                return
            try:
                with trio.fail_after(POLL_TIMEOUT_S):
                    response = await self.client.get(url, "/metrics", self._headers)
            except (UpstreamError, trio.TooSlowError):
                return
            if response.ok:
                texts[worker.index] = response.text

        async with trio.open_nursery() as nursery:
            for worker in self.workers:
                if worker.state == "up" and worker.dashboard_url:
                    nursery.start_soon(read, worker)
        up = {w.index: w.state == "up" for w in self.workers}
        restarts = {w.index: w.restarts for w in self.workers}
        return merge_worker_metrics(texts, up, restarts)

    def occupancy(self) -> dict[str, float]:
        """The tokenizers' occupancy summed over the workers, as of their last snapshots."""
        totals = {"threads_busy": 0.0, "queued": 0.0, "saturated_waiting": 0.0}
        fallback = 0.0
        for _, snapshot, _ in self._latest.values():
            threads = snapshot.get("preprocess", {}).get("threads")
            if threads:
                totals["threads_busy"] += threads["busy"]
                totals["queued"] += threads["queued"]
                totals["saturated_waiting"] += threads["saturated_waiting"]
            fallback += 1.0 if snapshot.get("preprocess", {}).get("fallback_busy") else 0.0
        return {**totals, "fallback_busy": fallback}

    async def snapshot(self) -> Snapshot:
        now = time.time()
        live = [self._latest[w.index][1] for w in self.workers if w.index in self._latest]
        # Before any worker answers, only what the supervisor knows itself: the page reads
        # every block as one that may be missing.
        merged = merge_snapshots(live) if live else cast(Snapshot, {})
        merged["time"] = trio.current_time()
        merged["wall_time"] = now
        merged.setdefault("preprocess", cast(PreprocessSnapshot, {}))["saturation"] = (
            self.saturation
        )
        requests = merged.setdefault("requests", cast(RequestsSnapshot, {}))
        requests["recent"] = self._records.recent()
        rows = [self._row(worker, now) for worker in self.workers]
        merged["workers"] = {
            "count": len(self.workers),
            "up": sum(1 for w in self.workers if w.state == "up"),
            "restarts": sum(w.restarts for w in self.workers),
            "rows": rows,
        }
        notices = [n for s in live for n in s.get("notices", ())]
        merged["notices"] = self._notices(now) + list({n["text"]: n for n in notices}.values())
        return merged

    def _row(self, worker: WorkerState, now: float) -> WorkerRow:
        latest = self._latest.get(worker.index)
        snapshot = latest[1] if latest is not None and latest[0] == worker.incarnation else None
        loop = snapshot.get("loop") if snapshot is not None else None
        return {
            "index": worker.index,
            "pid": worker.pid,
            "state": worker.state,
            "incarnation": worker.incarnation,
            "up_s": now - worker.started_at if worker.state == "up" else None,
            "restarts": worker.restarts,
            "last_exit": worker.last_exit,
            "last_exit_ago_s": None if worker.last_exit_at is None else now - worker.last_exit_at,
            "restart_in_s": None if worker.restart_at is None else max(worker.restart_at - now, 0),
            "requests_total": snapshot.get("requests", {}).get("total") if snapshot else None,
            "requests_per_s": self._rates.get(worker.index) if snapshot else None,
            "lag_max_recent_s": (loop.get("lag") or {}).get("max_recent") if loop else None,
            "stalls": (loop.get("stalls") or {}).get("count") if loop else None,
            "saturation": snapshot.get("preprocess", {}).get("saturation") if snapshot else None,
            "dashboard": worker.dashboard_url,
        }

    def _notices(self, now: float) -> list[Notice]:
        notices: list[Notice] = []
        for worker in self.workers:
            if worker.state == "restarting" and worker.restart_at is not None:
                notices.append(
                    {
                        "level": "error",
                        "text": f"worker {worker.index} (pid {worker.pid}) {worker.last_exit}: "
                        f"starting it again in {max(worker.restart_at - now, 0):.0f} s "
                        f"(restart {worker.restarts})",
                    }
                )
            elif worker.last_exit_at is not None and now - worker.last_exit_at < NOTICE_S:
                notices.append(
                    {
                        "level": "warning",
                        "text": f"worker {worker.index} {worker.last_exit} "
                        f"{now - worker.last_exit_at:.0f} s ago and was started again "
                        f"(pid {worker.pid}, {worker.restarts} restart(s))",
                    }
                )
        return notices
