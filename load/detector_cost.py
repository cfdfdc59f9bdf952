"""What the stall detector's per-step timer costs the proxy: throughput and CPU per request
with `--stall-instrument` vs `--no-stall-instrument`, side by side in one run.

One simulated backend, two proxies in front of it that differ only in that flag. Rounds
alternate between them; each round keeps `--concurrency` clients busy for `--seconds` and
counts completed requests, and reads the proxy's CPU time from /proc.

    python -m load detector-cost --rounds 10 --seconds 3

Target (issue 4): the instrument costs at most 3% of proxy throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from load.processes import start_instant_sim, start_proxy, stop_all

BODY = {"model": "sim", "messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 1}


@dataclass
class Round:
    mode: str
    requests: int
    errors: int
    seconds: float
    cpu_seconds: float

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_seconds / max(self.requests, 1) * 1e6


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    return ticks / 100.0


async def one_round(
    client: httpx.AsyncClient, url: str, pid: int, mode: str, concurrency: int, seconds: float
) -> Round:
    done = errors = 0
    deadline = trio.current_time() + seconds

    async def worker() -> None:
        nonlocal done, errors
        while trio.current_time() < deadline:
            try:
                response = await client.post(url + "/v1/chat/completions", json=BODY)
            except httpx.HTTPError:
                errors += 1
                continue
            if response.status_code == 200:
                done += 1
            else:
                errors += 1

    cpu_before, started = cpu_seconds(pid), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return Round(mode, done, errors, time.perf_counter() - started, cpu_seconds(pid) - cpu_before)


async def run(args: argparse.Namespace) -> dict[str, float]:
    processes: list[subprocess.Popen[bytes]] = []
    try:
        sim_url = await start_instant_sim(processes)
        proxies: dict[str, tuple[str, int]] = {}
        for mode in ("on", "off"):
            flag = "--stall-instrument" if mode == "on" else "--no-stall-instrument"
            url = await start_proxy(processes, sim_url, flag)
            proxies[mode] = (url, processes[-1].pid)
        rounds: list[Round] = []
        limits = httpx.Limits(max_connections=args.concurrency * 2)
        async with httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) as client:
            for url, pid in proxies.values():
                await one_round(client, url, pid, "warm-up", args.concurrency, 1.0)
            for index in range(args.rounds):
                order = ("on", "off") if index % 2 == 0 else ("off", "on")
                for mode in order:
                    url, pid = proxies[mode]
                    rounds.append(
                        await one_round(client, url, pid, mode, args.concurrency, args.seconds)
                    )
    finally:
        stop_all(processes)
    return summarize(rounds)


def summarize(rounds: list[Round]) -> dict[str, float]:
    def median(mode: str, attribute: str) -> float:
        return float(statistics.median(getattr(r, attribute) for r in rounds if r.mode == mode))

    result = {
        "on_requests_per_s": median("on", "per_second"),
        "off_requests_per_s": median("off", "per_second"),
        "on_cpu_us_per_request": median("on", "cpu_us_per_request"),
        "off_cpu_us_per_request": median("off", "cpu_us_per_request"),
        "errors": float(sum(r.errors for r in rounds)),
    }
    result["throughput_cost_percent"] = (
        1 - result["on_requests_per_s"] / result["off_requests_per_s"]
    ) * 100
    result["cpu_cost_percent"] = (
        result["on_cpu_us_per_request"] / result["off_cpu_us_per_request"] - 1
    ) * 100
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=10, help="rounds per mode")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one round")
    parser.add_argument("--concurrency", type=int, default=16, help="clients kept busy")


def main(args: argparse.Namespace) -> None:
    result = trio.run(run, args)
    print(json.dumps(result, indent=2))
    print(
        f"stall instrument on vs off: throughput {result['on_requests_per_s']:.0f} vs "
        f"{result['off_requests_per_s']:.0f} req/s ({result['throughput_cost_percent']:+.1f}%), "
        f"proxy CPU {result['on_cpu_us_per_request']:.0f} vs "
        f"{result['off_cpu_us_per_request']:.0f} µs/request ({result['cpu_cost_percent']:+.1f}%)"
    )
