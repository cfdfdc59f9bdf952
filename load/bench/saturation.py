"""`python -m load bench saturation`: `--saturation wait` vs `bail-out` under overload (seed
000's capacity-one fallback).

When threads and the fallback are busy, a request either waits for its tokens (needed for
billing and context limits) or bails out and is routed without them ("a request routed by
hash instead of prefix is slightly less optimal but doesn't block the event loop"). Two
proxies, each in front of its own two simulated backends (so each variant's prefix-cache hit
rate is its own), `--policy cache_aware`, with one tokenizer thread and a queue of 2 so that
the tokenizer saturates. Open loop: RAG requests at 20/s (shared system prompts: prefix
routing pays) and every second a burst of 12 unique ~4k-token prompts that miss every cache
(more than thread + queue + fallback hold). Rounds alternate. Reported: latency of all
requests, of the RAG ones and of the unique ones, the share routed without tokens
(`x-sluice-prompt-tokens: estimated`), and the backends' prefix-cache hit rate.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from load import arrivals, client, harness
from load.drive import send_plan
from load.harness import Bench, Scenario, Table
from load.plots import plot_bars
from load.stats import by_group, percentile, with_range
from load.workloads import Corpus, Request, completion, nonce, workload

VARIANTS = ("wait", "bail-out")
SIM_FLAGS = (
    "--prefill-overhead", "0.002",
    "--prefill-per-token", "0.00002",
    "--inter-token-latency", "0.001",
    "--max-num-seqs", "256",
)  # fmt: skip
PROXY_FLAGS = ("--tokenize-threads", "1", "--tokenize-queue", "2", "--policy", "cache_aware")
RATE, BURST, BURST_EVERY_S = 20.0, 12, 1.0
COLUMNS = ("all_p50_ms", "all_p99_ms", "rag_p99_ms", "unique_p99_ms", "no_tokens_pct",
           "prefix_hit_pct")  # fmt: skip


async def sim_prefix(sims: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in sims:
        state = (await client.call(url + "/sim/state", give_up_s=10)).json()
        hits += state["prefix_cache_hits"]
        queries += state["prefix_cache_queries"]
    return hits, queries


def plan(seconds: float, seed: int) -> list[tuple[float, Request]]:
    rag = workload("rag", 7)  # the same system prompts every round: prefix locality pays
    rng, corpus = random.Random(seed), Corpus.default()
    out = [(at, rag.next()[0]) for at in arrivals.schedule("poisson", RATE, seconds, seed)]
    for k in range(int(seconds / BURST_EVERY_S)):
        for _ in range(BURST):  # a burst of misses: more than threads + queue + fallback
            text = f"{nonce(rng)} {corpus.text(rng, 4000)}"
            out.append((0.5 + k * BURST_EVERY_S, completion(text, 4, "unique")))
    return out


async def measure(bench: Bench) -> dict[str, Any]:
    rounds, seconds = bench.rounds(2, 4), bench.pick(5.0, 10.0)
    sims: dict[str, list[str]] = {}
    urls: dict[str, str] = {}
    for variant in VARIANTS:
        sims[variant] = [await bench.stack.sim(*SIM_FLAGS) for _ in range(2)]
        urls[variant] = await bench.stack.proxy(
            sims[variant], *PROXY_FLAGS, "--saturation", variant
        )
        await harness.wait_healthy(urls[variant])

    async def one(variant: str, number: int) -> dict[str, Any]:
        hits0, queries0 = await sim_prefix(sims[variant])
        records = await send_plan(urls[variant], plan(seconds, number))
        hits1, queries1 = await sim_prefix(sims[variant])
        ok = [r for r in records if r.ok and r.e2e is not None]

        def ms(q: float, tag: str | None = None) -> float:
            return percentile([r.e2e or 0.0 for r in ok if tag in (None, r.tag)], q) * 1e3

        estimated = sum(1 for r in ok if r.prompt_tokens == "estimated")
        return {
            "requests": len(records),
            "errors": len(records) - len(ok),
            "all_p50_ms": ms(50),
            "all_p99_ms": ms(99),
            "rag_p99_ms": ms(99, "chat"),
            "unique_p99_ms": ms(99, "unique"),
            "no_tokens_pct": 100 * estimated / len(ok) if ok else float("nan"),
            "prefix_hit_pct": 100 * (hits1 - hits0) / (queries1 - queries0)
            if queries1 > queries0
            else float("nan"),
        }

    rows = await bench.alternate(rounds, VARIANTS, one)
    return {
        "flags": list(PROXY_FLAGS),
        "summary": by_group(rows, "variant", COLUMNS),
        "rounds": rows,
    }


def tables(result: dict[str, Any]) -> list[Table]:
    summary = result["summary"]
    rounds = next(iter(summary.values()))["rounds"]
    return [
        Table(
            f"{' '.join(result['flags'])}; RAG at {RATE:g}/s + every second {BURST} unique "
            f"~4k-token prompts at once; medians of {rounds} rounds (range)",
            ["saturation", "all p50 ms", "all p99 ms", "RAG p99 ms", "unique p99 ms",
             "no tokens %", "prefix hit %", "errors"],
            [[v, *(with_range(s, c) for c in COLUMNS), s["errors"]] for v, s in summary.items()],
        )
    ]  # fmt: skip


def plot(result: dict[str, Any], png: Path) -> None:
    plot_bars(
        "Saturated tokenizer: wait vs bail-out",
        ["all p50", "all p99", "RAG p99", "unique p99"],
        {v: [s[c] for c in COLUMNS[:4]] for v, s in result["summary"].items()},
        "ms (log)",
        png,
        log=True,
    )


SCENARIO = Scenario(
    name="saturation",
    reproduces="seed 000",
    about="a saturated tokenizer: --saturation wait vs bail-out, latency vs prefix hits",
    reference=(
        "seed 000: under a burst of misses the fallback semaphore lets the 2nd, 3rd, 4th miss\n"
        "either wait (latency for those requests) or bail out (routed by hash, prefix locality\n"
        "lost). Read: bail-out should cut the unique prompts' and RAG p99, at the price of a\n"
        "share routed without tokens and of the backends' prefix hit rate."
    ),
    measure=measure,
    tables=tables,
    plot=plot,
)
