"""What every scenario shares: its processes, Prometheus scrapes, alternating rounds, the
side-by-side table, and the JSON + PNG written to `load/results/`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import trio

from load import processes

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"


class Stack:
    """The processes of one scenario; `async with Stack() as stack:` stops them all."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        self.pids: dict[str, int] = {}

    async def __aenter__(self) -> Stack:
        return self

    async def __aexit__(self, *exc: object) -> None:
        processes.stop_all(self.processes)

    async def sim(self, *flags: str, instant: bool = False) -> str:
        start = processes.start_instant_sim if instant else processes.start_sim
        url = await start(self.processes, *flags)
        self.pids[url] = self.processes[-1].pid
        return url

    async def proxy(
        self, backends: str | Sequence[str], *flags: str, source: Path | None = None
    ) -> str:
        url = await processes.start_proxy(self.processes, backends, *flags, source=source)
        self.pids[url] = self.processes[-1].pid
        return url

    async def command(
        self,
        argv: Sequence[str],
        url: str,
        health: str = "/health",
        env: dict[str, str] | None = None,
    ) -> int:
        """A foreign process (SMG, LiteLLM) serving at `url`; waits until `health` answers."""
        process = subprocess.Popen(
            list(argv),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.processes.append(process)
        self.pids[url] = process.pid
        async with httpx.AsyncClient(trust_env=False, timeout=2) as client:
            with trio.fail_after(90):
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(f"{argv[0]} exited ({process.returncode})")
                    try:
                        if (await client.get(url + health)).status_code < 500:
                            return process.pid
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(0.2)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value}."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                samples[key] = float(value)
            except ValueError:
                continue
    return samples


async def scrape(client: httpx.AsyncClient, url: str, path: str = "/metrics") -> dict[str, float]:
    response = await client.get(url + path)
    response.raise_for_status()
    return parse_metrics(response.text)


def metric(samples: dict[str, float], name: str) -> float | None:
    """The sum of every series of `name` (all label sets); None when absent."""
    values = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    return sum(values) if values else None


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    now = metric(after, name)
    return None if now is None else now - (metric(before, name) or 0.0)


def label_values(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    """{label value: summed value} over the series of `name`; {} when absent."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        if not key.startswith(name + "{"):
            continue
        for part in key[len(name) + 1 : -1].split(","):
            k, _, v = part.partition("=")
            if k == label:
                out[v.strip('"')] = out.get(v.strip('"'), 0.0) + value
    return out


def alternate(rounds: int, variants: Sequence[str]) -> Iterator[tuple[int, str]]:
    """Rounds of every variant, the order reversed every other round (noise falls evenly)."""
    for index in range(rounds):
        order = list(variants) if index % 2 == 0 else list(reversed(variants))
        for variant in order:
            yield index + 1, variant


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 1) -> str:
    cells = [[str(h) for h in headers], *[[fmt(c, digits) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def write(name: str, blob: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write `<name>.json` (with the date and machine) and return the PNG path beside it."""
    directory = out_dir or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"scenario": name, "machine": machine(), **blob}, indent=1))
    return path.with_suffix(".png")


def report(name: str, seed_note: str, text: str, png: Path) -> None:
    print(f"\n== {name} ({time.strftime('%Y-%m-%d')}) ==\n{text}\n\n{seed_note}")
    print(f"wrote {png.with_suffix('.json')} and {png}")


class HealthProbe:
    """GET /health every `interval` on one keep-alive connection while the body of
    `async with probe.running(url):` runs; the latencies are how long the loop froze."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.latencies: list[float] = []

    @asynccontextmanager
    async def running(self, url: str) -> AsyncIterator[HealthProbe]:
        self.latencies = []
        ready = trio.Event()
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            await client.get(url + "/health")  # open the connection first
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._loop, client, url, ready)
                await ready.wait()
                yield self
                nursery.cancel_scope.cancel()

    async def _loop(self, client: httpx.AsyncClient, url: str, ready: trio.Event) -> None:
        ready.set()
        while True:
            sent = time.perf_counter()
            await client.get(url + "/health")
            self.latencies.append(time.perf_counter() - sent)
            await trio.sleep(self.interval)


async def wait_healthy(url: str) -> None:
    """Wait (30 s at most) until `url` answers /health with 200."""
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        with trio.fail_after(30):
            while True:
                try:
                    if (await client.get(url + "/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.1)
