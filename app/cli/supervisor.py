"""`sluice serve --workers N`: N proxy processes on one port, one dashboard, one supervisor.

The supervisor holds the proxy port (`reserve_port`) and starts N workers, each `python -m
app.cli.worker` in a session of its own (a terminal's Ctrl-C reaches the supervisor
alone, which passes it on once). Each worker is a whole Sluice (its own Trio loop, relay,
caches, KV-event subscribers, health checks) that listens on the shared port with
SO_REUSEPORT and serves its own dashboard on a private loopback port; the supervisor's
dashboard, on `--dashboard-port`, shows them together (`WorkersView`).

A worker that dies is started again, and says so in the log and on the page; when one dies
again soon after starting, each wait before the next start doubles (`RestartBackoff`, up to
30 s), so a crash loop costs little. One that fails before it ever listened stops everything
(a bad flag or tokenizer would only fail again): the exit status is the worker's. SIGINT or
SIGTERM: every worker is told to finish its requests within `--shutdown-grace`, then the
supervisor exits; a second signal is passed on too (workers stop at once) and anything still
running past the grace is killed.

Why processes on one port rather than one process: one event loop is one core, and a Python
process never runs two threads of Python at once; the kernel spreading connections over
listeners costs nothing per request. `--workers 1` (the default) is the single process of
`app.cli.serve`, without any of this.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import secrets
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from app.config import Saturation, Settings
from app.errors import ConfigError
from app.http.listeners import reserve_port

log = logging.getLogger("sluice.supervisor")

READY_TIMEOUT_S = 120.0  # loading a tokenizer, warming the render workers
MAX_READY_LINE = 4096
# How long past --shutdown-grace a worker may take to exit before it is killed.
EXIT_MARGIN_S = 5.0
ORDER_HEADER = struct.Struct("!Q")


class WorkerStartFailed(ConfigError):
    """A worker exited before it ever listened: no use starting it again."""

    def __init__(self, index: int, status: str, returncode: int | None) -> None:
        super().__init__(f"worker {index} {status} before listening")
        self.returncode = returncode


@dataclass
class RestartBackoff:
    """How long to wait before starting a worker again. Pure.

    The first restart waits `initial`; each one after a run shorter than `stable_after`
    doubles the wait, up to `maximum`; a run that lasted `stable_after` starts over."""

    initial: float = 0.5
    maximum: float = 30.0
    stable_after: float = 60.0
    _delay: float = 0.0

    def next_delay(self, ran_for: float) -> float:
        if ran_for >= self.stable_after or self._delay == 0.0:
            self._delay = self.initial
        else:
            self._delay = min(self._delay * 2, self.maximum)
        return self._delay


@dataclass
class WorkerState:
    """One worker slot; each start is a new incarnation (the page reads it: WorkersView)."""

    index: int
    state: str = "starting"  # starting | up | restarting | stopped
    incarnation: int = 0
    pid: int | None = None
    dashboard_url: str | None = None
    started_at: float = 0.0  # wall clock
    restarts: int = 0
    last_exit: str | None = None
    last_exit_at: float | None = None  # wall clock
    restart_at: float | None = None  # wall clock
    backoff: RestartBackoff = field(default_factory=RestartBackoff)


@dataclass(frozen=True)
class WorkerOrder:
    """What a worker is told on its channel before anything else."""

    index: int
    settings: Settings


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.saturation: Saturation = settings.saturation
        # The workers' own dashboards answer the supervisor's writes only.
        self.worker_token = secrets.token_urlsafe(24)
        self.workers = [WorkerState(index) for index in range(settings.workers)]
        self.shutdown = trio.Event()
        self.stopped = trio.Event()  # every worker has exited
        self.port = settings.port
        self._processes: dict[int, trio.Process] = {}
        self._running = 0
        self._workers_stopped = trio.Event()

    def worker_settings(self) -> Settings:
        """A worker's settings: the shared port, a private dashboard, the policy in force
        (`workers` stays N: each worker's budgets hold their share)."""
        return replace(
            self.settings,
            port=self.port,
            dashboard_host="127.0.0.1",
            dashboard_port=0,
            admin_token=self.worker_token,
            saturation=self.saturation,
        )

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every worker, report the port once all listen, run until `shutdown`."""
        self.port, reservation = reserve_port(self.settings.host, self.settings.port)
        try:
            async with trio.open_nursery() as nursery:
                # All at once: each takes seconds to load its tokenizer.
                async with trio.open_nursery() as starting:
                    for worker in self.workers:
                        starting.start_soon(nursery.start, self._keep_running, worker)
                task_status.started(self.port)
                await self.shutdown.wait()
                self.signal_workers(signal.SIGTERM)
                with trio.move_on_after(self.settings.shutdown_grace + EXIT_MARGIN_S):
                    await self._workers_stopped.wait()
                if self._processes:
                    log.warning("killing %d worker(s) still running", len(self._processes))
                    self.signal_workers(signal.SIGKILL)
        finally:
            for sock in reservation:
                sock.close()
            self.stopped.set()

    def signal_workers(self, signum: int) -> None:
        for process in list(self._processes.values()):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)

    async def _keep_running(
        self, worker: WorkerState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the worker, start it again whenever it dies, until shutdown."""
        self._running += 1
        try:
            await self._restart_until_shutdown(worker, task_status)
        finally:
            worker.state = "stopped"
            self._running -= 1
            if not self._running:
                self._workers_stopped.set()

    async def _restart_until_shutdown(
        self, worker: WorkerState, task_status: trio.TaskStatus[None]
    ) -> None:
        ever_ready = False
        while not self.shutdown.is_set():
            started = trio.current_time()
            returncode, was_ready = await self._run_once(worker, task_status, ever_ready)
            ever_ready = ever_ready or was_ready
            status = describe_exit(returncode)
            worker.dashboard_url = None
            worker.last_exit, worker.last_exit_at = status, time.time()
            if self.shutdown.is_set():
                break
            if not ever_ready:
                raise WorkerStartFailed(worker.index, status, returncode)
            delay = worker.backoff.next_delay(trio.current_time() - started)
            worker.restarts += 1
            worker.state = "restarting"
            worker.restart_at = time.time() + delay
            log.warning(
                "worker %d (pid %s) %s after %.1fs; starting it again in %.1fs (restart %d)",
                worker.index,
                worker.pid,
                status,
                trio.current_time() - started,
                delay,
                worker.restarts,
            )
            with trio.move_on_after(delay):
                await self.shutdown.wait()

    async def _run_once(
        self, worker: WorkerState, task_status: trio.TaskStatus[None], ever_ready: bool
    ) -> tuple[int, bool]:
        """One incarnation, start to exit: (its return code, whether it ever listened)."""
        ours, theirs = socket.socketpair()
        worker.incarnation += 1
        worker.state = "starting"
        worker.restart_at = None
        try:
            with theirs:
                process = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "app.cli.worker", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
            channel = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        except BaseException:
            ours.close()
            raise
        worker.pid = process.pid
        self._processes[worker.index] = process
        ready = False
        try:
            async with channel, trio.open_nursery() as nursery:
                order = pickle.dumps(WorkerOrder(worker.index, self.worker_settings()))
                await channel.send_all(ORDER_HEADER.pack(len(order)) + order)
                hello = await _read_line(channel, process)
                if hello is not None:
                    ready = True
                    worker.dashboard_url = hello["dashboard"]
                    worker.started_at = time.time()
                    worker.state = "up"
                    if not ever_ready:
                        task_status.started()
                    log.info("worker %d (pid %d) is listening", worker.index, process.pid)
                # Holding our end open is how the worker knows the supervisor lives.
                nursery.start_soon(_drain, channel)
                await process.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._processes.pop(worker.index, None)
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
        assert process.returncode is not None
        return process.returncode, ready


async def _read_line(channel: trio.SocketStream, process: trio.Process) -> dict[str, Any] | None:
    """The worker's first line (JSON: pid, proxy and dashboard URLs), or None if it exited
    or said nothing in time."""
    buffer = b""
    with trio.move_on_after(READY_TIMEOUT_S):
        while b"\n" not in buffer and len(buffer) < MAX_READY_LINE:
            data = await channel.receive_some(MAX_READY_LINE)
            if not data:
                return None
            buffer += data
    if b"\n" not in buffer:
        log.error("worker pid %d did not report in time: stopping it", process.pid)
        process.kill()
        return None
    hello: dict[str, Any] = json.loads(buffer.split(b"\n", 1)[0])
    return hello


async def _drain(channel: trio.SocketStream) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while await channel.receive_some(MAX_READY_LINE):
            pass


def worker_exit_status(exc: BaseException) -> int | None:
    """The exit status `sluice` takes from a worker that failed to start, if it did."""
    if isinstance(exc, WorkerStartFailed):
        return 2 if exc.returncode is None or exc.returncode <= 0 else exc.returncode
    return None
