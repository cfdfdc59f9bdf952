"""Proxy overhead: latency through Sluice minus latency straight to the same simulated
backend (in another process), at a fixed open-loop rate, non-streaming.

Direct and proxied requests alternate in one run, so both see the same machine noise.

    python -m load overhead --rate 200 --duration 20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from dataclasses import dataclass

import httpx
import trio

from load.processes import start_instant_sim, start_proxy, stop_all
from load.stats import percentile

BODY = {
    "model": "sim",
    "messages": [{"role": "user", "content": "Say one word."}],
    "max_tokens": 1,
}


@dataclass
class Samples:
    direct: list[float]
    proxied: list[float]
    errors: int = 0


async def _one(client: httpx.AsyncClient, url: str, out: list[float], samples: Samples) -> None:
    started = time.perf_counter()
    try:
        response = await client.post(url, json=BODY)
    except httpx.HTTPError:
        samples.errors += 1
        return
    if response.status_code != 200:
        samples.errors += 1
        return
    out.append(time.perf_counter() - started)


async def measure(direct_url: str, proxy_url: str, rate: float, duration: float) -> Samples:
    samples = Samples([], [])
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) as client:
        # Warm up both paths (connection pools, first-request costs).
        for _ in range(50):
            await _one(client, direct_url, [], samples)
            await _one(client, proxy_url, [], samples)
        samples.errors = 0
        total = int(rate * duration)
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(total):
                await trio.sleep_until(start + i / rate)
                if i % 2 == 0:
                    nursery.start_soon(_one, client, direct_url, samples.direct, samples)
                else:
                    nursery.start_soon(_one, client, proxy_url, samples.proxied, samples)
    return samples


def report(samples: Samples, rate: float) -> dict[str, float]:
    ms = 1000.0
    result = {
        "rate_per_s": rate,
        "requests": float(len(samples.direct) + len(samples.proxied)),
        "errors": float(samples.errors),
        "direct_p50_ms": percentile(samples.direct, 50) * ms,
        "direct_p99_ms": percentile(samples.direct, 99) * ms,
        "proxied_p50_ms": percentile(samples.proxied, 50) * ms,
        "proxied_p99_ms": percentile(samples.proxied, 99) * ms,
    }
    result["added_p50_ms"] = result["proxied_p50_ms"] - result["direct_p50_ms"]
    result["added_p99_ms"] = result["proxied_p99_ms"] - result["direct_p99_ms"]
    return result


async def run(args: argparse.Namespace) -> dict[str, float]:
    processes: list[subprocess.Popen[bytes]] = []
    try:
        sim_url = await start_instant_sim(processes)
        proxy_url = await start_proxy(processes, sim_url, *args.proxy_arg)
        samples = await measure(
            sim_url + "/v1/chat/completions",
            proxy_url + "/v1/chat/completions",
            args.rate,
            args.duration,
        )
    finally:
        stop_all(processes)
    return report(samples, args.rate)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rate", type=float, default=200.0, help="requests per second (both paths)"
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of measurement")
    parser.add_argument(
        "--proxy-arg", action="append", default=[], help="extra flag for `sluice serve`"
    )


def main(args: argparse.Namespace) -> None:
    result = trio.run(run, args)
    print(json.dumps(result, indent=2))
    print(
        f"added latency: p50 {result['added_p50_ms']:.3f} ms, p99 {result['added_p99_ms']:.3f} ms "
        f"at {args.rate:g} req/s ({int(result['errors'])} errors)"
    )
