"""Start Sluice and simulated backends as separate processes, as a user would run them.

Each binds port 0 and prints its URL; we read the URL from its output, so benchmarks never
race for ports.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import trio

URL_PATTERN = re.compile(rb"(http://127\.0\.0\.1:\d+)")

# A simulated backend whose GPU time is zero: what remains is HTTP and the proxy's own work.
INSTANT_SIM = (
    "sim-backend",
    "--port", "0",
    "--prefill-overhead", "0",
    "--prefill-per-token", "0",
    "--inter-token-latency", "0",
    "--max-num-seqs", "1024",
)  # fmt: skip


@contextmanager
def _terminating(process: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


async def start_instant_sim(stack: list[subprocess.Popen[bytes]], *extra: str) -> str:
    return await start_process([*INSTANT_SIM, *extra], b"Simulated backend", stack)


async def start_proxy(stack: list[subprocess.Popen[bytes]], backend: str, *extra: str) -> str:
    """`sluice serve` in front of `backend` on free ports, quiet but for warnings."""
    serve = ("serve", "--backend", backend, "--port", "0", "--dashboard-port", "0")
    return await start_process([*serve, "--log-level", "warning", *extra], b"Sluice proxy", stack)


async def start_process(
    args: Sequence[str], marker: bytes, stack: list[subprocess.Popen[bytes]]
) -> str:
    """Run `python -m app ARGS`, wait for the line holding `marker`, return its URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "app", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    stack.append(process)
    assert process.stdout is not None
    stdout = process.stdout
    with trio.fail_after(30):
        while True:
            line = await trio.to_thread.run_sync(stdout.readline)
            if not line:
                raise RuntimeError(f"`sluice {' '.join(args)}` exited before listening")
            if marker in line:
                match = URL_PATTERN.search(line)
                if match:
                    return match.group(1).decode()


def stop_all(stack: list[subprocess.Popen[bytes]]) -> None:
    for process in reversed(stack):
        with _terminating(process):
            pass
