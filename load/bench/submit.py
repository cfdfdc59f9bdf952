"""`python -m load bench submit`: seed 003's submit path, through a proxy.

Seed 003 moved `tokenizer.encode()` out of the server's `add_request()` into worker threads
and measured the submit path: "Submit wall" (256 requests handed over) 79.2 -> 29.9 ms and
`add_request` p99 0.35 -> 0.05 ms. Here the submit path is everything before a request is
handed to a backend. Two proxies (`--tokenize-mode inline` and `offload`) in front of one
instant simulated backend: its first token comes at once, so a streamed request's TTFT is
the proxy's submit time plus one hop. Each round sends, all at once, 32 unique ~4k-token
prompts (the concurrent long prompts) and 32 short ones, streaming `max_tokens: 1`.
Reported: TTFT of short and long requests (p50, p99), the submit wall (first send to the
last first token), and the proxy's own tokenize time (`server-timing`). Rounds alternate.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import trio

from load.bench import common
from load.client import Record, new_client, send
from load.plots import plot_bars
from load.stats import percentile
from load.workloads import Corpus, chat, completion, nonce

VARIANTS = {"inline": ("--tokenize-mode", "inline"), "offload": ()}
LONG, SHORT = 32, 32
SEED_NOTE = (
    "seed 003 (GPT-2, 256 requests burst-submitted): submit wall 79.2 -> 29.9 ms (2.6x),\n"
    "add_request p99 0.35 -> 0.05 ms (7x) once encode left the submit path. Read: offload\n"
    "should hand the short requests over without waiting for the long ones' tokenization\n"
    "(short TTFT), where inline makes every request wait behind every encode."
)


async def one_round(
    url: str, rng: random.Random, corpus: Corpus, variant: str, number: int
) -> dict[str, Any]:
    requests = [
        completion(f"{nonce(rng)} {corpus.text(rng, 4000)}", 1, "long") for _ in range(LONG)
    ]
    for _ in range(SHORT):
        short = chat([{"role": "user", "content": f"{nonce(rng)} Say one word."}], 1)
        requests.append(type(short)(short.path, short.body, "short"))
    rng.shuffle(requests)
    records: list[Record] = []
    async with new_client(LONG + SHORT) as client:
        start = time.perf_counter()

        async def fire(request: Any) -> None:
            records.append(await send(client, url, request, True, start))

        async with trio.open_nursery() as nursery:
            for request in requests:
                nursery.start_soon(fire, request)
    ok = [r for r in records if r.ok and r.ttft is not None]

    def ttft(tag: str) -> list[float]:
        return [r.ttft for r in ok if r.tag == tag and r.ttft is not None]

    return {
        "round": number,
        "variant": variant,
        "errors": len(records) - len(ok),
        "short_ttft_p50_ms": percentile(ttft("short"), 50) * 1e3,
        "short_ttft_p99_ms": percentile(ttft("short"), 99) * 1e3,
        "long_ttft_p50_ms": percentile(ttft("long"), 50) * 1e3,
        "long_ttft_p99_ms": percentile(ttft("long"), 99) * 1e3,
        "submit_wall_ms": max((r.start + (r.ttft or 0.0) for r in ok), default=float("nan")) * 1e3,
        "tokenize_p50_ms": statistics.median(
            r.timing.get("tokenize", 0.0) for r in ok if r.tag == "long"
        )
        * 1e3
        if any(r.tag == "long" for r in ok)
        else float("nan"),
    }


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rounds = args.rounds or (3 if args.quick else 8)
    rng, corpus = random.Random(3), Corpus.default()
    results = []
    async with common.Stack() as stack:
        sim = await stack.sim("--max-model-len", "1000000", "--max-num-seqs", "1024", instant=True)
        urls = {
            n: await stack.proxy(sim, "--max-model-len", "1000000", *f) for n, f in VARIANTS.items()
        }
        for url in urls.values():
            await common.wait_healthy(url)
            await one_round(url, rng, corpus, "warm-up", 0)
        for number, variant in common.alternate(rounds, list(VARIANTS)):
            results.append(await one_round(urls[variant], rng, corpus, variant, number))
    return results


COLUMNS = (
    "short_ttft_p50_ms",
    "short_ttft_p99_ms",
    "long_ttft_p50_ms",
    "long_ttft_p99_ms",
    "submit_wall_ms",
    "tokenize_p50_ms",
)


def main(args: argparse.Namespace) -> None:
    results = trio.run(measure, args)
    summary = {
        v: {c: statistics.median(r[c] for r in results if r["variant"] == v) for c in COLUMNS}
        | {"errors": sum(r["errors"] for r in results if r["variant"] == v)}
        for v in VARIANTS
    }
    png = common.write("submit", {"summary": summary, "rounds": results}, args.out_dir)
    plot_bars(
        f"{LONG} long + {SHORT} short requests at once: time to first token",
        ["short p50", "short p99", "long p50", "long p99", "submit wall"],
        {v: [s[c] for c in COLUMNS[:5]] for v, s in summary.items()},
        "ms",
        png,
    )
    headers = [
        "tokenize",
        "short TTFT p50",
        "short p99",
        "long TTFT p50",
        "long p99",
        "submit wall",
        "tokenize p50",
        "errors",
    ]
    rows = [[v, *[s[c] for c in COLUMNS], int(s["errors"])] for v, s in summary.items()]
    ratio = summary["inline"]["submit_wall_ms"] / summary["offload"]["submit_wall_ms"]
    common.report(
        "submit",
        SEED_NOTE,
        f"{LONG} unique ~4k-token + {SHORT} short prompts sent at once, medians of "
        f"{len(results) // 2} rounds, ms\n"
        + common.table(headers, rows)
        + f"\nsubmit wall inline / offload: {ratio:.2f}x; short TTFT p99 inline / offload: "
        f"{summary['inline']['short_ttft_p99_ms'] / summary['offload']['short_ttft_p99_ms']:.1f}x",
        png,
    )
