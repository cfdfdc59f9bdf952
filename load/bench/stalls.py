"""`python -m load bench stalls`: seed 000's pathological case, side by side.

"A burst of 20 cache misses in a row blocks your event loop for 200ms. Every request that
arrives during those 200ms — including the ones that would have been cache hits — waits."

Three proxies in front of one instant simulated backend: `inline` (the naive baseline:
tokenize on the loop, no caches), `offload` (worker threads, caches off) and
`offload+caches` (the default). In each round, for each proxy in turn: cheap requests (one
short chat, repeated: a cache hit where caches exist) arrive at 50/s while /health is polled
every 5 ms, and half a second in, 20 unique large prompts arrive at once. Reported: the
cheap requests' p50/p99, /health p99 and worst, the stall detector's total and the loop
lag's highest bucket.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import httpx
import trio

from load.bench import common
from load.burst import lag_max_bucket
from load.client import Record, new_client, send
from load.plots import plot_bars
from load.stats import percentile
from load.workloads import Corpus, Request, chat, completion, nonce

VARIANTS = {
    "inline": ("--tokenize-mode", "inline"),
    "offload": ("--l0-max-entries", "0", "--l1-max-memory", "0"),
    "offload+caches": (),
}
CHEAP_RATE = 50.0
BURST_SIZE = 20
MAX_MODEL_LEN = "1000000"
SEED_NOTE = (
    "seed 000: 20 cache misses in a row block an event loop ~200 ms (5-13 ms each); every\n"
    "request arriving meanwhile waits, cache hits included. Read: inline's worst /health and\n"
    "cheap p99 should show that freeze; offload keeps the loop free (worst /health ~ ms)."
)


async def one_round(
    url: str, large_tokens: int, rng: random.Random, corpus: Corpus, variant: str, number: int
) -> dict[str, Any]:
    cheap = chat([{"role": "user", "content": "Say one word."}], 1)
    large = [
        completion(f"{nonce(rng)} {corpus.text(rng, large_tokens)}", 1, "large")
        for _ in range(BURST_SIZE)
    ]
    cheap_records: list[Record] = []
    large_records: list[Record] = []
    probe = common.HealthProbe()
    async with new_client(64) as client:
        before = await common.scrape(client, url)
        start = time.perf_counter()

        async def fire(request: Request, out: list[Record]) -> None:
            out.append(await send(client, url, request, False, start))

        async with probe.running(url), trio.open_nursery() as nursery:
            t0 = trio.current_time()
            burst_at: float | None = t0 + 0.5
            for i in range(int(CHEAP_RATE * 30)):
                await trio.sleep_until(t0 + i / CHEAP_RATE)
                if burst_at is not None and trio.current_time() >= burst_at:
                    burst_at = None
                    burst_started = time.perf_counter()
                    for request in large:
                        nursery.start_soon(fire, request, large_records)
                nursery.start_soon(fire, cheap, cheap_records)
                if burst_at is None and len(large_records) == BURST_SIZE:
                    burst_wall = time.perf_counter() - burst_started
                    break
            else:
                burst_wall = float("nan")
            await trio.sleep(0.3)  # cheap requests just after the burst, too
        await trio.sleep(0.1)  # the stall detector records a freeze once the loop runs again
        after = await common.scrape(client, url)
    cheap_ok = [r.e2e for r in cheap_records if r.ok and r.e2e is not None]
    return {
        "round": number,
        "variant": variant,
        "cheap_requests": len(cheap_records),
        "errors": sum(1 for r in cheap_records + large_records if not r.ok),
        "cheap_p50_ms": percentile(cheap_ok, 50) * 1e3,
        "cheap_p99_ms": percentile(cheap_ok, 99) * 1e3,
        "health_p99_ms": percentile(probe.latencies, 99) * 1e3,
        "health_worst_ms": max(probe.latencies, default=float("nan")) * 1e3,
        "burst_wall_ms": burst_wall * 1e3,
        "stall_ms": (common.delta(before, after, "sluice_event_loop_stall_seconds_sum") or 0.0)
        * 1e3,
        "lag_max_bucket_ms": (lag_max_bucket(before, after) or float("nan")) * 1e3,
        "large_prompt_tokens": statistics.mean(
            int(r.prompt_tokens)
            for r in large_records
            if r.prompt_tokens and r.prompt_tokens.isdigit()
        )
        if any(r.prompt_tokens and r.prompt_tokens.isdigit() for r in large_records)
        else float("nan"),
    }


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rounds = args.rounds or (2 if args.quick else 5)
    large_tokens = 2000 if args.quick else 4000
    rng = random.Random(0)
    corpus = Corpus.default()
    results = []
    async with common.Stack() as stack:
        sim = await stack.sim("--max-model-len", MAX_MODEL_LEN, instant=True)
        urls = {
            name: await stack.proxy(sim, "--max-model-len", MAX_MODEL_LEN, *flags)
            for name, flags in VARIANTS.items()
        }
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            for url in urls.values():
                await common.wait_healthy(url)
                for _ in range(3):
                    await client.post(
                        url + "/v1/chat/completions",
                        json=chat([{"role": "user", "content": "Say one word."}], 1).body,
                    )
        for number, variant in common.alternate(rounds, list(VARIANTS)):
            results.append(
                await one_round(urls[variant], large_tokens, rng, corpus, variant, number)
            )
    return results


COLUMNS = (
    "cheap_p50_ms",
    "cheap_p99_ms",
    "health_p99_ms",
    "health_worst_ms",
    "stall_ms",
    "lag_max_bucket_ms",
    "burst_wall_ms",
)


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per variant: the median over rounds of each column (worst /health: the max)."""
    out: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        rows = [r for r in results if r["variant"] == variant]
        out[variant] = {c: statistics.median(r[c] for r in rows) for c in COLUMNS}
        out[variant]["health_worst_ms"] = max(r["health_worst_ms"] for r in rows)
        out[variant]["errors"] = sum(r["errors"] for r in rows)
        out[variant]["large_prompt_tokens"] = statistics.mean(
            r["large_prompt_tokens"] for r in rows
        )
    return out


def main(args: argparse.Namespace) -> None:
    results = trio.run(measure, args)
    summary = summarize(results)
    png = common.write("stalls", {"summary": summary, "rounds": results}, args.out_dir)
    plot_bars(
        f"Bursts of {BURST_SIZE} unique ~{summary['inline']['large_prompt_tokens']:.0f}-token "
        "prompts among cheap requests",
        ["cheap p99", "/health p99", "/health worst", "stall total"],
        {
            v: [s["cheap_p99_ms"], s["health_p99_ms"], s["health_worst_ms"], s["stall_ms"]]
            for v, s in summary.items()
        },
        "ms (log)",
        png,
        log=True,
    )
    headers = [
        "variant",
        "cheap p50",
        "cheap p99",
        "/health p99",
        "/health worst",
        "stalls ms",
        "lag <= ms",
        "burst ms",
        "errors",
    ]
    rows = [[v, *[s[c] for c in COLUMNS], int(s["errors"])] for v, s in summary.items()]
    common.report(
        "stalls",
        SEED_NOTE,
        f"{BURST_SIZE} unique prompts of ~{summary['inline']['large_prompt_tokens']:.0f} tokens "
        f"per burst, cheap requests at {CHEAP_RATE:g}/s, medians of "
        f"{len(results) // len(VARIANTS)} rounds (worst /health: max), ms\n"
        + common.table(headers, rows),
        png,
    )
