"""Start Sluice and simulated backends as separate processes, as a user would run them.

Each binds port 0 and prints its URL; we read the URL from its output, so benchmarks never
race for ports. Output goes to a log file, not a pipe: a pipe nobody drains would block a
process that logs a lot (a soak's proxy does), and the log is what a crash report needs.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import trio

URL_PATTERN = re.compile(r"(http://127\.0\.0\.1:\d+)")
LOG_DIR = Path(tempfile.gettempdir()) / "sluice-load-logs"

# The model every workload names: the simulated backends serve it under that name (Sluice
# routes by model, and a name no backend lists is a 404).
MODEL = "sim"
# A simulated backend whose GPU time is zero: what remains is HTTP and the proxy's own work.
INSTANT_SIM = (
    "sim-backend",
    "--port", "0",
    "--model", MODEL,
    "--prefill-overhead", "0",
    "--prefill-per-token", "0",
    "--inter-token-latency", "0",
    "--max-num-seqs", "1024",
)  # fmt: skip


def free_port() -> int:
    """A port nothing listens on now, for a process that must be told its port up front."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def log_path(process: subprocess.Popen[bytes]) -> Path:
    return LOG_DIR / f"{process.pid}.log"


async def start_instant_sim(stack: list[subprocess.Popen[bytes]], *extra: str) -> str:
    return await start_process([*INSTANT_SIM, *extra], "Simulated backend", stack)


async def start_sim(stack: list[subprocess.Popen[bytes]], *extra: str) -> str:
    """`sluice sim-backend` with its default (GPU-like) latency model on a free port."""
    arguments = ["sim-backend", "--port", "0", "--model", MODEL, *extra]
    return await start_process(arguments, "Simulated backend", stack)


async def start_proxy(
    stack: list[subprocess.Popen[bytes]],
    backend: str | Sequence[str],
    *extra: str,
    source: Path | None = None,
) -> str:
    """`sluice serve` in front of `backend`(s) on free ports, quiet but for warnings;
    `source`: a directory holding another version's `app/` to run instead."""
    backends = [backend] if isinstance(backend, str) else list(backend)
    serve = ["serve", "--port", "0", "--dashboard-port", "0"]
    for url in backends:
        serve += ["--backend", url]
    args = [*serve, "--log-level", "warning", *extra]
    return await start_process(args, "Sluice proxy", stack, source)


async def start_process(
    args: Sequence[str],
    marker: str | bytes,
    stack: list[subprocess.Popen[bytes]],
    source: Path | None = None,
) -> str:
    """Run `python -m app ARGS` (from `source` if given: `-m` looks in the working directory
    first), wait for the line holding `marker`, return its URL."""
    if isinstance(marker, bytes):  # the earlier benchmarks pass bytes
        marker = marker.decode()
    LOG_DIR.mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=LOG_DIR, suffix=".log", delete=False) as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "app", *args], stdout=log, stderr=subprocess.STDOUT, cwd=source
        )
    os.replace(log.name, log_path(process))
    stack.append(process)
    with trio.fail_after(60):
        while True:
            text = log_path(process).read_text(errors="replace")
            for line in text.splitlines():
                match = URL_PATTERN.search(line)
                if marker in line and match:
                    return match.group(1)
            if process.poll() is not None:
                raise RuntimeError(
                    f"`sluice {' '.join(args)}` exited ({process.returncode}) before listening:\n"
                    + text[-2000:]
                )
            await trio.sleep(0.05)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stop_all(stack: list[subprocess.Popen[bytes]]) -> None:
    for process in reversed(stack):
        stop(process)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
