"""The processes a benchmark runs, each known by its PID: `sluice serve`, `sluice sim-backend`,
the floors, the peers (SMG, LiteLLM where installed, Redis) and the /health probe. `async with
Stack() as stack:` stops them all, whatever happens.

Each of ours binds port 0 and prints its URL; we read the URL from its log, so benchmarks never
race for ports. Output goes to a log file, not a pipe: a pipe nobody drains would block a
process that logs a lot (a soak's proxy does), and the log is what a crash report needs.
CPU and RSS come from /proc (Linux), for a process and everything it started. Each `sluice
serve` is asked, as it is stopped, how long it held requests while an engine reported room
(issue 40 keeps that at zero in every bench): `held_with_room()` sums what this process's
stacks read.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import trio

from load.client import FAILURES, call

URL_PATTERN = re.compile(r"(http://127(?:\.\d+){3}:\d+)")  # any loopback address
LOG_DIR = Path(tempfile.gettempdir()) / "sluice-load-logs"
SMG_BIN = Path(os.environ.get("SMG_BIN", "/tmp/venv-smg/bin/smg"))
LITELLM_BIN = Path(os.environ.get("LITELLM_BIN", "/tmp/venv-litellm/bin/litellm"))
LITELLM_KEY = "sk-sluice-bench"
# The model every workload names: the simulated backends serve it under that name (Sluice
# routes by model, and a name no backend lists is a 404).
MODEL = "sim"
# A simulated backend whose GPU time is zero: what remains is HTTP and the proxy's own work.
INSTANT = (
    "--prefill-overhead", "0",
    "--prefill-per-token", "0",
    "--inter-token-latency", "0",
    "--max-num-seqs", "1024",
)  # fmt: skip


HELD_WITH_ROOM = "sluice_admission_held_with_room_seconds_total"
# What the Sluices stopped so far said of HELD_WITH_ROOM: [processes asked, seconds in all].
_held_with_room = [0, 0.0]


def held_with_room() -> dict[str, float]:
    """The Sluices stopped since the last `forget_held_with_room`: how many answered, and
    the seconds they held requests while an engine reported room, in all."""
    return {"proxies": _held_with_room[0], "seconds": round(_held_with_room[1], 6)}


def forget_held_with_room() -> None:
    _held_with_room[:] = [0, 0.0]


async def read_held_with_room(url: str) -> None:
    """Add what the Sluice at `url` says of HELD_WITH_ROOM (nothing if it does not answer)."""
    try:
        reply = await call(url + "/metrics", give_up_s=5)
    except FAILURES:
        return
    if reply.status != 200:
        return
    seconds = sum(
        float(line.rsplit(" ", 1)[1])
        for line in reply.text.splitlines()
        if line.startswith(HELD_WITH_ROOM)
    )
    _held_with_room[0] += 1
    _held_with_room[1] += seconds


def free_port() -> int:
    """A port nothing listens on now, for a process that must be told its port up front."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def log_path(process: subprocess.Popen[bytes]) -> Path:
    return LOG_DIR / f"{process.pid}.log"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, from /proc."""
    return _stat_cpu(Path(f"/proc/{pid}/stat"))


def helper_threads_cpu(pid: int) -> dict[int, float]:
    """{thread id: CPU seconds} of a process's threads but its first (a Python process's
    main thread, Sluice's event loop): its worker and exporter threads, those alive now."""
    threads: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        if task.name != str(pid):
            try:
                threads[int(task.name)] = _stat_cpu(task / "stat")
            except OSError:
                continue  # the thread ended meanwhile
    return threads


def threads_cpu_since(before: dict[int, float], now: dict[int, float]) -> float:
    """CPU seconds the threads of `now` spent since `before` was read: a thread started
    meanwhile counts whole, one that ended meanwhile is not counted."""
    return sum(cpu - before.get(thread, 0.0) for thread, cpu in now.items())


def _stat_cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (render workers; SMG and LiteLLM fork)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_seconds(current)
        except OSError:
            continue
        todo.extend(children.get(current, []))
    return total


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Stack:
    """The processes of one benchmark, stopped in reverse order on exit; `pids` maps each
    server's URL to the PID whose CPU it is measured by."""

    def __init__(self, proxy_flags: Sequence[str] = ()) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        self.pids: dict[str, int] = {}
        self.proxies: list[str] = []  # the `sluice serve` URLs, asked at their stop
        self.proxy_flags = list(proxy_flags)  # added to every `sluice serve` (--proxy-arg)

    async def __aenter__(self) -> Stack:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with trio.CancelScope(shield=True):
            for url in self.proxies:
                await read_held_with_room(url)
        for process in reversed(self.processes):
            stop(process)

    async def sim(self, *flags: str, instant: bool = False, model: str = MODEL) -> str:
        """`sluice sim-backend` serving `model` on a free port (`instant`: no GPU time at all)."""
        args = ["sim-backend", "--port", "0", "--model", model, *(INSTANT if instant else ())]
        return await self.app([*args, *flags], "Simulated backend")

    async def sims(self, count: int, *flags: str, model: str = MODEL) -> list[str]:
        """`count` simulated backends started at once (`--seed` 0, 1, ...), in seed order."""
        urls: dict[int, str] = {}

        async def start(seed: int) -> None:
            urls[seed] = await self.sim("--seed", str(seed), *flags, model=model)

        async with trio.open_nursery() as nursery:
            for seed in range(count):
                nursery.start_soon(start, seed)
        return [urls[seed] for seed in range(count)]

    async def proxy(
        self, backends: str | Sequence[str], *flags: str, source: Path | None = None
    ) -> str:
        """`sluice serve` in front of `backends`, quiet but for warnings; `source`: a directory
        holding another version's `app/` to run instead of this one."""
        args = ["serve", "--port", "0", "--dashboard-port", "0", "--log-level", "warning"]
        for url in [backends] if isinstance(backends, str) else backends:
            args += ["--backend", url]
        url = await self.app([*args, *self.proxy_flags, *flags], "Sluice proxy", source)
        self.proxies.append(url)
        return url

    def dashboard(self, proxy: str) -> str:
        """The dashboard URL of the `sluice serve` answering at `proxy` (printed just after
        the proxy's own)."""
        text = (LOG_DIR / f"{self.pids[proxy]}.log").read_text(errors="replace")
        for line in text.splitlines():
            match = URL_PATTERN.search(line)
            if "Sluice dashboard" in line and match:
                return match.group(1)
        raise RuntimeError(f"the proxy at {proxy} printed no dashboard URL")

    async def app(self, args: Sequence[str], marker: str, source: Path | None = None) -> str:
        """Run `python -m app ARGS` (from `source` if given: `-m` looks in the working
        directory first), wait for the log line holding `marker`, return its URL."""
        LOG_DIR.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=LOG_DIR, suffix=".log", delete=False) as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "app", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=source,
            )
        os.replace(log.name, log_path(process))
        self.processes.append(process)
        with trio.fail_after(60):
            while True:
                text = log_path(process).read_text(errors="replace")
                for line in text.splitlines():
                    match = URL_PATTERN.search(line)
                    if marker in line and match:
                        self.pids[match.group(1)] = process.pid
                        return match.group(1)
                if process.poll() is not None:
                    raise RuntimeError(
                        f"`sluice {' '.join(args)}` exited ({process.returncode}) before "
                        f"listening:\n{text[-2000:]}"
                    )
                await trio.sleep(0.05)

    def died(self) -> list[str]:
        """The processes that exited while they were meant to serve, with where their log is."""
        return [
            f"pid {p.pid} exited {p.returncode}; its log: "
            f"{log_path(p) if log_path(p).exists() else 'none (a foreign process)'}"
            for p in self.processes
            if p.poll() is not None
        ]

    def forget(self, process: subprocess.Popen[bytes]) -> None:
        """A process that died or was killed on purpose: no longer stopped at the end."""
        self.processes.remove(process)

    async def stop(self, *urls: str) -> None:
        """Stop the servers at `urls` as at the end (SIGTERM: a Sluice flushes its spans),
        from a thread: this process may be serving what they send as they stop."""
        processes = [p for p in self.processes if p.pid in {self.pids[url] for url in urls}]
        for url in urls:
            if url in self.proxies:
                self.proxies.remove(url)
                await read_held_with_room(url)
        for process in processes:
            await trio.to_thread.run_sync(stop, process)
            self.forget(process)

    def kill(self, url: str) -> None:
        """SIGKILL the process serving at `url` mid-run (a fault injected on purpose)."""
        process = next(p for p in self.processes if p.pid == self.pids[url])
        if url in self.proxies:
            self.proxies.remove(url)
        process.kill()
        process.wait()
        self.forget(process)

    async def command(
        self,
        argv: Sequence[str],
        url: str,
        health: str = "/health",
        env: dict[str, str] | None = None,
    ) -> int:
        """A foreign process serving at `url`; waits (90 s at most) until `health` answers."""
        process = subprocess.Popen(
            list(argv),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.processes.append(process)
        self.pids[url] = process.pid
        with trio.fail_after(90):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{argv[0]} exited ({process.returncode})")
                try:
                    if (await call(url + health, give_up_s=2)).status < 500:
                        return process.pid
                except FAILURES:
                    pass
                await trio.sleep(0.2)

    async def redis(self) -> str:
        """A redis-server of our own (Debian's) on a free port, nothing saved to disk; its
        redis:// URL once it accepts connections (10 s at most)."""
        port = free_port()
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.processes.append(process)
        url = f"redis://127.0.0.1:{port}/0"
        self.pids[url] = process.pid
        with trio.fail_after(10):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"redis-server exited ({process.returncode})")
                try:
                    await (await trio.open_tcp_stream("127.0.0.1", port)).aclose()
                    return url
                except OSError:
                    await trio.sleep(0.05)

    async def floor(self, kind: str) -> str:
        """load/floors.py: a server that answers without a backend ("hypercorn" or "h11")."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        await self.command([sys.executable, "-m", "load.floors", kind, str(port)], url)
        return url

    async def smg(self, workers: Sequence[str], policy: str) -> str | None:
        """SMG in front of `workers`, once every worker is healthy in its eyes; None when it is
        not installed or did not start (said on stdout: a peer left out is not an error)."""
        if not await trio.Path(SMG_BIN).exists():
            return None
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [str(SMG_BIN), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *workers, "--policy", policy, "--log-level", "warn",
                "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port())]  # fmt: skip
        try:
            await self.command(argv, url)
            with trio.fail_after(60):
                while True:
                    try:
                        listed = (await call(url + "/workers", give_up_s=2)).json()["workers"]
                        if sum(1 for w in listed if w.get("is_healthy")) == len(workers):
                            return url
                    except (*FAILURES, KeyError):  # json's errors are ValueErrors
                        pass
                    await trio.sleep(0.2)
        except (RuntimeError, trio.TooSlowError) as exc:
            print(f"smg did not start: {exc}")
            return None

    async def litellm(self, backend: str, model: str) -> tuple[str, dict[str, str]] | None:
        """The LiteLLM proxy (one worker) in front of `backend`: its URL and the headers it
        wants; None when it is not installed or did not start."""
        if not await trio.Path(LITELLM_BIN).exists():
            return None
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        config = Path(tempfile.mkdtemp()) / "litellm.yaml"
        config.write_text(
            f"model_list:\n  - model_name: {model}\n    litellm_params:\n"
            f"      model: openai/{model}\n      api_base: {backend}/v1\n      api_key: unused\n"
        )
        env = {
            "LITELLM_MASTER_KEY": LITELLM_KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: no cost map download
            "LITELLM_LOG": "ERROR",
        }
        argv = [str(LITELLM_BIN), "--config", str(config), "--host", "127.0.0.1",
                "--port", str(port), "--num_workers", "1"]  # fmt: skip
        try:
            await self.command(argv, url, "/health/liveliness", env)
        except (RuntimeError, trio.TooSlowError) as exc:
            print(f"litellm did not start: {exc}")
            return None
        return url, {"authorization": f"Bearer {LITELLM_KEY}"}
