"""`python -m load bench cache`: tokenizer cache hit rates per workload (seed 001).

SMG's tokenizer-caching page claims "60-90% cache hit rates in typical production
workloads" for L0 (exact text) and, for L1 (prefix at special-token boundaries), that turn 2
of a conversation "tokenizes only ~20% of the content", an ~80% saving. Two proxies in front
of one instant simulated backend: `caches` (the default) and `no-caches` (`--l0-max-entries
0 --l1-max-memory 0`). Each workload (rag, hot, chat, unique, mixed, its own seed, so no
workload warms another's cache) is sent to both, 4 clients in a closed loop; the caches'
counters come from the proxy's `/metrics`, the tokenize time from `server-timing`. L1's
saving is 1 - tokenize time with caches / without, on the same requests.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import httpx
import trio

from load.bench import common
from load.client import Record, new_client, send
from load.plots import plot_bars
from load.stats import mean_or_nan
from load.workloads import workload

WORKLOADS = ("rag", "hot", "chat", "unique", "mixed")
VARIANTS = {"caches": (), "no-caches": ("--l0-max-entries", "0", "--l1-max-memory", "0")}
CLIENTS = 4
PREFIX = "sluice_tokenizer_cache_"
SEED_NOTE = (
    "seed 001 (SMG): L0 60-90% hit rate for repeated prompts (system prompts, RAG); L1 on\n"
    "multi-turn: turn 2 tokenizes ~20% of the content (~80% saved). seed 000 expects 80-90%\n"
    "on system messages and 10-30% on user queries. Read: rag/hot should land in L0's range\n"
    "(whole-prompt hits need the same question, so here L1 carries them), chat in L1's;\n"
    "unique is the floor."
)


async def send_all(url: str, name: str, seed: int, count: int) -> list[Record]:
    source = workload(name, seed)
    requests = [r for _ in range(count) for r in source.next()][:count]
    records: list[Record] = []
    async with new_client(CLIENTS) as client:
        queue = iter(requests)

        async def worker() -> None:
            for request in queue:
                records.append(await send(client, url, request, False, 0.0))

        async with trio.open_nursery() as nursery:
            for _ in range(CLIENTS):
                nursery.start_soon(worker)
    return records


def counters(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    names = ("l0_hits_total", "l0_misses_total", "l1_hits_total", "l1_misses_total")
    out = {name: common.delta(before, after, PREFIX + name) for name in names}
    # Hits by tokens, where the proxy exports them (an open issue adds them).
    for key in sorted({series.partition("{")[0] for series in after}):  # every model's
        if key.startswith(PREFIX) and "token" in key and key.endswith("_total"):
            out[key[len(PREFIX) :]] = common.delta(before, after, key)
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    count = 80 if args.quick else 400
    results: dict[str, Any] = {}
    async with common.Stack() as stack:
        sim = await stack.sim("--max-model-len", "1000000", instant=True)
        urls = {
            n: await stack.proxy(sim, "--max-model-len", "1000000", *f) for n, f in VARIANTS.items()
        }
        for url in urls.values():
            await common.wait_healthy(url)
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            for seed, name in enumerate(WORKLOADS, start=100):
                row: dict[str, Any] = {}
                for variant, url in urls.items():
                    before = await common.scrape(client, url)
                    records = await send_all(url, name, seed, count)
                    after = await common.scrape(client, url)
                    tokenize = [r.timing.get("tokenize", 0.0) for r in records if r.ok]
                    tokens = [
                        int(r.prompt_tokens or 0)
                        for r in records
                        if (r.prompt_tokens or "").isdigit()
                    ]
                    row[variant] = {
                        "ok": sum(r.ok for r in records),
                        "tokenize_mean_ms": mean_or_nan(tokenize) * 1e3,
                        "tokenize_p50_ms": statistics.median(tokenize) * 1e3
                        if tokenize
                        else float("nan"),
                        "prompt_tokens_mean": mean_or_nan(tokens),
                        "prompt_tokens_sum": sum(tokens),
                        "counters": counters(before, after),
                    }
                results[name] = row
    return results


def rates(row: dict[str, Any]) -> dict[str, float]:
    c = row["caches"]["counters"]
    l0_hits, l0_misses = c["l0_hits_total"] or 0.0, c["l0_misses_total"] or 0.0
    l1_hits, l1_misses = c["l1_hits_total"] or 0.0, c["l1_misses_total"] or 0.0
    lookups = l0_hits + l0_misses
    with_caches = row["caches"]["tokenize_mean_ms"]
    without = row["no-caches"]["tokenize_mean_ms"]
    hit_tokens = [c.get(f"{level}_hit_tokens_total") for level in ("l0", "l1")]
    prompt_tokens = row["caches"]["prompt_tokens_sum"]
    by_tokens = (
        100 * sum(t or 0.0 for t in hit_tokens) / prompt_tokens
        if prompt_tokens and any(t is not None for t in hit_tokens)
        else float("nan")
    )
    return {
        "tokens_hit_pct": by_tokens,
        "l0_hit_pct": 100 * l0_hits / lookups if lookups else float("nan"),
        "l1_hit_pct_of_l0_misses": 100 * l1_hits / (l1_hits + l1_misses)
        if l1_hits + l1_misses
        else float("nan"),
        "any_hit_pct": 100 * (l0_hits + l1_hits) / lookups if lookups else float("nan"),
        "tokenize_ms_caches": with_caches,
        "tokenize_ms_no_caches": without,
        "tokenize_saved_pct": 100 * (1 - with_caches / without) if without else float("nan"),
        "prompt_tokens": row["caches"]["prompt_tokens_mean"],
    }


def main(args: argparse.Namespace) -> None:
    results = trio.run(measure, args)
    table = {name: rates(row) for name, row in results.items()}
    png = common.write("cache", {"summary": table, "raw": results}, args.out_dir)
    plot_bars(
        "Tokenizer caches per workload",
        list(table),
        {
            "L0 hit %": [t["l0_hit_pct"] for t in table.values()],
            "L0 or L1 hit %": [t["any_hit_pct"] for t in table.values()],
            "tokens from cache %": [t["tokens_hit_pct"] for t in table.values()],
            "tokenize time saved %": [t["tokenize_saved_pct"] for t in table.values()],
        },
        "% of requests / of tokenize time",
        png,
    )
    headers = [
        "workload",
        "prompt tok",
        "L0 hit %",
        "L1 hit % of L0 misses",
        "any hit %",
        "tokens hit %",
        "tokenize ms (caches)",
        "tokenize ms (none)",
        "saved %",
    ]
    rows = [
        [
            name,
            t["prompt_tokens"],
            t["l0_hit_pct"],
            t["l1_hit_pct_of_l0_misses"],
            t["any_hit_pct"],
            t["tokens_hit_pct"],
            t["tokenize_ms_caches"],
            t["tokenize_ms_no_caches"],
            t["tokenize_saved_pct"],
        ]
        for name, t in table.items()
    ]
    note = (
        "tokens hit %: prompt tokens served by L0 or L1 (sluice_tokenizer_cache_l*_hit_tokens)\n"
        "over all prompt tokens; n/a where the proxy does not export those counters"
    )
    common.report("cache", SEED_NOTE, common.table(headers, rows) + "\n" + note, png)
