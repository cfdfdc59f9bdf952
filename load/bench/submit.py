"""`python -m load bench submit`: seed 003's submit path, through a proxy.

Seed 003 moved `tokenizer.encode()` out of the server's `add_request()` into worker threads
and measured the submit path: "Submit wall" (256 requests handed over) 79.2 -> 29.9 ms and
`add_request` p99 0.35 -> 0.05 ms. Here the submit path is everything before a request is
handed to a backend. Two proxies (`--tokenize-mode inline` and `offload`) in front of one
instant simulated backend: its first token comes at once, so a streamed request's TTFT is
the proxy's submit time plus one hop. Each round sends, all at once, 32 unique ~4k-token
prompts and 32 short ones, streaming `max_tokens: 1`. Reported: TTFT of short and long
requests (p50, p99), the submit wall (first send to the last first token), and the proxy's
own tokenize time (`server-timing`). Rounds alternate.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

from load import harness
from load.drive import send_plan
from load.harness import Bench, Scenario, Table
from load.plots import plot_bars
from load.stats import by_group, percentile, with_range
from load.workloads import Corpus, Request, chat, completion, nonce

VARIANTS = {"inline": ("--tokenize-mode", "inline"), "offload": ()}
MAX_MODEL_LEN = ("--max-model-len", "1000000")
LONG, SHORT = 32, 32
COLUMNS = ("short_ttft_p50_ms", "short_ttft_p99_ms", "long_ttft_p50_ms", "long_ttft_p99_ms",
           "submit_wall_ms", "tokenize_p50_ms")  # fmt: skip


async def one_round(url: str, rng: random.Random) -> dict[str, Any]:
    corpus = Corpus.default()
    requests = [
        completion(f"{nonce(rng)} {corpus.text(rng, 4000)}", 1, "long") for _ in range(LONG)
    ]
    for _ in range(SHORT):
        short = chat([{"role": "user", "content": f"{nonce(rng)} Say one word."}], 1)
        requests.append(Request(short.path, short.body, "short"))
    rng.shuffle(requests)
    records = await send_plan(url, [(0.0, r) for r in requests], stream=True)
    ok = [r for r in records if r.ok and r.ttft is not None]

    def ttft(tag: str, q: float) -> float:
        return percentile([r.ttft or 0.0 for r in ok if r.tag == tag], q) * 1e3

    tokenize = [r.timing.get("tokenize", 0.0) for r in ok if r.tag == "long"]
    return {
        "errors": len(records) - len(ok),
        "short_ttft_p50_ms": ttft("short", 50),
        "short_ttft_p99_ms": ttft("short", 99),
        "long_ttft_p50_ms": ttft("long", 50),
        "long_ttft_p99_ms": ttft("long", 99),
        "submit_wall_ms": max((r.start + (r.ttft or 0.0) for r in ok), default=float("nan")) * 1e3,
        "tokenize_p50_ms": statistics.median(tokenize) * 1e3 if tokenize else float("nan"),
    }


async def measure(bench: Bench) -> dict[str, Any]:
    rng = random.Random(3)
    sim = await bench.stack.sim(*MAX_MODEL_LEN, instant=True)
    urls = {v: await bench.stack.proxy(sim, *MAX_MODEL_LEN, *f) for v, f in VARIANTS.items()}
    for url in urls.values():
        await harness.wait_healthy(url)
        await one_round(url, rng)  # warm-up: connections, threads, first-request costs

    async def one(variant: str, number: int) -> dict[str, Any]:
        return await one_round(urls[variant], rng)

    rows = await bench.alternate(bench.rounds(3, 8), list(VARIANTS), one)
    return {"summary": by_group(rows, "variant", COLUMNS), "rounds": rows}


def tables(result: dict[str, Any]) -> list[Table]:
    s = result["summary"]
    ratio = s["inline"]["submit_wall_ms"] / s["offload"]["submit_wall_ms"]
    short = s["inline"]["short_ttft_p99_ms"] / s["offload"]["short_ttft_p99_ms"]
    return [
        Table(
            f"{LONG} unique ~4k-token + {SHORT} short prompts sent at once, ms, medians of "
            f"{s['inline']['rounds']} rounds (range); submit wall inline / offload "
            f"{ratio:.2f}x, short TTFT p99 inline / offload {short:.2f}x",
            ["tokenize", "short TTFT p50", "short p99", "long TTFT p50", "long p99",
             "submit wall", "tokenize p50 (long)", "errors"],
            [[v, *(with_range(r, c) for c in COLUMNS), r["errors"]] for v, r in s.items()],
        )
    ]  # fmt: skip


def plot(result: dict[str, Any], png: Path) -> None:
    plot_bars(
        f"{LONG} long + {SHORT} short requests at once: time to first token",
        ["short p50", "short p99", "long p50", "long p99", "submit wall"],
        {v: [s[c] for c in COLUMNS[:5]] for v, s in result["summary"].items()},
        "ms",
        png,
    )


SCENARIO = Scenario(
    name="submit",
    reproduces="seed 003",
    about="time before a request reaches a backend: inline vs offload under a burst",
    reference=(
        "seed 003 (GPT-2, 256 requests burst-submitted): submit wall 79.2 -> 29.9 ms (2.6x),\n"
        "add_request p99 0.35 -> 0.05 ms (7x) once encode left the submit path. Read: offload\n"
        "should hand the short requests over without waiting for the long ones' tokenization\n"
        "(short TTFT), where inline makes every request wait behind every encode."
    ),
    measure=measure,
    tables=tables,
    plot=plot,
)
