"""`python -m load bench sidecar`: seed 002's experiment 7, the sidecar pattern.

A monolithic Python server templates and tokenizes every prompt itself, one request at a
time (the GIL); a sidecar does it before the server, which then receives token ids. Here the
simulated backend charges `--preprocess-per-token` seconds per prompt token, serialized, to
every prompt that arrives as text or messages, and nothing to token ids; it tokenizes with
the same DeepSeek tokenizer as Sluice, so `--forward tokens` is allowed. Two variants, each
its own proxy in front of its own backend: `passthrough` (Sluice forwards the JSON: the
backend preprocesses, the monolith) and `tokens` (Sluice sends token ids: the sidecar).
RAG prompts of ~2-4k tokens, closed loop at 50 clients (seed phase 1) and 200 (phase 2),
rounds alternating.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from load import drive, harness
from load.client import Pool
from load.harness import Bench, Scenario, Table
from load.plots import plot_bars
from load.runner import requests, summarize
from load.stats import by_group, with_range

PER_TOKEN = "0.000004"  # 10 ms of server CPU for a 2,500-token prompt
SIM_FLAGS = (
    "--tokenize-with", "default",
    "--preprocess-per-token", PER_TOKEN,
    "--prefill-overhead", "0.002",
    "--prefill-per-token", "0.00001",
    "--inter-token-latency", "0.002",
    "--max-num-seqs", "256",
)  # fmt: skip
VARIANTS = ("passthrough", "tokens")
COLUMNS = ("req_per_s", "p50_ms", "p99_ms")


async def measure(bench: Bench) -> dict[str, Any]:
    rounds, seconds = bench.rounds(2, 3), bench.pick(6.0, 12.0)
    urls = {}
    for variant in VARIANTS:
        urls[variant] = await bench.stack.proxy(
            await bench.stack.sim(*SIM_FLAGS), "--forward", variant
        )
        await harness.wait_healthy(urls[variant])
    summary: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for clients in bench.pick((50,), (50, 200)):

        async def one(variant: str, number: int, clients: int = clients) -> dict[str, Any]:
            async with Pool(urls[variant], timeout=300) as pool:
                source = (pool.prepare(r) for r in requests("rag", number))
                run = await drive.closed_loop(pool, clients, source, seconds=seconds)
            result = summarize(run.records, run.seconds, {})
            return {
                "clients": clients,
                "req_per_s": result["requests_per_s"],
                "p50_ms": result["latency_ms"]["e2e"]["p50"],
                "p99_ms": result["latency_ms"]["e2e"]["p99"],
                "errors": result["requests"] - result["ok"],
            }

        level = await bench.alternate(rounds, VARIANTS, one, f" {clients} clients")
        summary[str(clients)] = by_group(level, "variant", COLUMNS)
        rows += level
    return {"per_token_s": PER_TOKEN, "summary": summary, "rounds": rows}


def tables(result: dict[str, Any]) -> list[Table]:
    rows = []
    for clients, by_variant in result["summary"].items():
        base = by_variant["passthrough"]["req_per_s"]
        for variant, s in by_variant.items():
            cells = [with_range(s, c) for c in COLUMNS]
            rows.append([clients, variant, *cells, s["req_per_s"] / base, s["errors"]])
    return [
        Table(
            f"the backend charges {result['per_token_s']} s a token to text prompts, "
            "serialized; RAG ~2-4k tokens; medians of rounds (range)",
            ["clients", "--forward", "req/s", "p50 ms", "p99 ms", "x passthrough", "errors"],
            rows,
        )
    ]


def plot(result: dict[str, Any], png: Path) -> None:
    summary = result["summary"]
    plot_bars(
        "Monolith (passthrough) vs sidecar (tokens): throughput",
        [f"{c} clients" for c in summary],
        {v: [summary[c][v]["req_per_s"] for c in summary] for v in VARIANTS},
        "req/s",
        png,
    )


SCENARIO = Scenario(
    name="sidecar",
    reproduces="seed 002 exp 7",
    about="--forward passthrough vs tokens, the backend charging for preprocessing",
    reference=(
        "seed 002 exp 7 (SGLang, ~2,500-token prompts): 50 users monolith 118 req/s p50 379 ms,\n"
        "sidecar 179 req/s p50 212 ms; 400 users monolith 179 req/s p50 1,997 ms, sidecar 303\n"
        "req/s p50 1,017 ms (1.5-1.7x throughput). Read: `tokens` should raise throughput and\n"
        "cut p50 the same way, by the backend's serialized preprocessing it no longer pays."
    ),
    measure=measure,
    tables=tables,
    plot=plot,
)
