"""`python -m load bench saturation`: `--saturation wait` vs `bail-out` under overload.

Seed 000's capacity-one fallback: when threads and the fallback are busy, a request either
waits for its tokens (needed for correctness: billing, context limits) or bails out and is
routed without them ("a request routed by hash instead of prefix is slightly less optimal
but doesn't block the event loop"). Two proxies, each in front of its own two simulated
backends (so each variant's prefix-cache hit rate is its own), with one tokenizer thread and
a queue of 2 so the tokenizer saturates. Traffic, open loop: RAG requests at 20/s (shared
system prompts: prefix routing pays) and, every second, a burst of 12 unique ~4k-token
prompts that miss every cache (more than thread + queue + fallback hold). Variants
alternate in rounds. Reported: latency of all requests and of the RAG ones, the share
routed without tokens (`x-sluice-prompt-tokens: estimated`), the backends' prefix-cache hit
rate (from their `/sim/state`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import httpx
import trio

from load import arrivals
from load.bench import common
from load.client import Record, new_client, send
from load.plots import plot_bars
from load.stats import percentile
from load.workloads import Corpus, completion, nonce, workload

VARIANTS = ("wait", "bail-out")
SIM_FLAGS = (
    "--prefill-overhead", "0.002",
    "--prefill-per-token", "0.00002",
    "--inter-token-latency", "0.001",
    "--max-num-seqs", "256",
)  # fmt: skip
BURST, BURST_EVERY_S = 12, 1.0
PROXY_FLAGS = ("--tokenize-threads", "1", "--tokenize-queue", "2")
POLICY = ("--policy", "cache_aware")
SEED_NOTE = (
    "seed 000: under a burst of misses the fallback semaphore lets the 2nd, 3rd, 4th miss\n"
    "either wait (latency for those requests) or bail out (routed by hash, prefix locality\n"
    "lost). Read: bail-out should cut the unique prompts' and RAG p99, at the price of a\n"
    "share routed without tokens and a lower backend prefix hit rate (`cache_aware` routes\n"
    "by prefix: a request without tokens is routed by hash)."
)


async def sim_prefix(client: httpx.AsyncClient, sims: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in sims:
        state = (await client.get(url + "/sim/state")).json()
        hits += state["prefix_cache_hits"]
        queries += state["prefix_cache_queries"]
    return hits, queries


async def one_round(
    url: str, sims: list[str], rate: float, seconds: float, seed: int, variant: str
) -> dict[str, Any]:
    rag = workload("rag", 7)  # the same system prompts every round: prefix locality pays
    rng = random.Random(seed)
    corpus = Corpus.default()
    times = arrivals.schedule("poisson", rate, seconds, seed)
    records: list[Record] = []
    async with new_client(512) as client:
        hits0, queries0 = await sim_prefix(client, sims)
        start = time.perf_counter()

        async def fire(request: Any) -> None:
            records.append(await send(client, url, request, False, start))

        async with trio.open_nursery() as nursery:
            t0 = trio.current_time()
            next_burst = 0.5
            for at in times:
                await trio.sleep_until(t0 + at)
                if at >= next_burst:  # a burst of misses: more than threads + queue + fallback
                    next_burst += BURST_EVERY_S
                    for _ in range(BURST):
                        text = f"{nonce(rng)} {corpus.text(rng, 4000)}"
                        nursery.start_soon(fire, completion(text, 4, "unique"))
                nursery.start_soon(fire, rag.next()[0])
        hits1, queries1 = await sim_prefix(client, sims)
    ok = [r for r in records if r.ok]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    rag_e2e = [r.e2e for r in ok if r.tag == "chat" and r.e2e is not None]
    unique_e2e = [r.e2e for r in ok if r.tag == "unique" and r.e2e is not None]
    estimated = sum(1 for r in ok if r.prompt_tokens == "estimated")
    return {
        "variant": variant,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "all_p50_ms": percentile(e2e, 50) * 1e3,
        "all_p99_ms": percentile(e2e, 99) * 1e3,
        "rag_p99_ms": percentile(rag_e2e, 99) * 1e3,
        "unique_p99_ms": percentile(unique_e2e, 99) * 1e3,
        "no_tokens_pct": 100 * estimated / len(ok) if ok else float("nan"),
        "prefix_hit_pct": 100 * (hits1 - hits0) / (queries1 - queries0)
        if queries1 > queries0
        else float("nan"),
    }


async def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    rounds = args.rounds or (2 if args.quick else 4)
    seconds = 5.0 if args.quick else 10.0
    rate = 20.0
    results = []
    async with common.Stack() as stack:
        sims: dict[str, list[str]] = {}
        urls: dict[str, str] = {}
        for variant in VARIANTS:
            sims[variant] = [await stack.sim(*SIM_FLAGS) for _ in range(2)]
            urls[variant] = await stack.proxy(
                sims[variant], *PROXY_FLAGS, *POLICY, "--saturation", variant
            )
            await common.wait_healthy(urls[variant])
        for number, variant in common.alternate(rounds, VARIANTS):
            row = await one_round(urls[variant], sims[variant], rate, seconds, number, variant)
            results.append({"round": number, **row})
    return results, " ".join(POLICY)


COLUMNS = (
    "all_p50_ms",
    "all_p99_ms",
    "rag_p99_ms",
    "unique_p99_ms",
    "no_tokens_pct",
    "prefix_hit_pct",
)


def main(args: argparse.Namespace) -> None:
    results, policy = trio.run(measure, args)
    summary = {
        v: {c: statistics.median(r[c] for r in results if r["variant"] == v) for c in COLUMNS}
        | {"errors": sum(r["errors"] for r in results if r["variant"] == v)}
        for v in VARIANTS
    }
    png = common.write(
        "saturation", {"policy": policy, "summary": summary, "rounds": results}, args.out_dir
    )
    plot_bars(
        "Saturated tokenizer: wait vs bail-out",
        ["all p50", "all p99", "RAG p99", "unique p99"],
        {
            v: [s["all_p50_ms"], s["all_p99_ms"], s["rag_p99_ms"], s["unique_p99_ms"]]
            for v, s in summary.items()
        },
        "ms (log)",
        png,
        log=True,
    )
    headers = [
        "saturation",
        "all p50 ms",
        "all p99 ms",
        "RAG p99 ms",
        "unique p99 ms",
        "no tokens %",
        "prefix hit %",
        "errors",
    ]
    rows = [[v, *[s[c] for c in COLUMNS], int(s["errors"])] for v, s in summary.items()]
    common.report(
        "saturation",
        SEED_NOTE,
        f"1 tokenizer thread, queue 2, {policy}; RAG at 20/s + every second {BURST} unique "
        "~4k-token prompts at once, "
        f"medians of {len(results) // 2} rounds\n" + common.table(headers, rows),
        png,
    )
