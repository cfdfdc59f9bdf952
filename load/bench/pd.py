"""`python -m load bench pd`: prefill/decode disaggregation against aggregated engines
(issue 43).

The same 4 simulated GPUs three ways, each behind its own `sluice serve`, taking turns by
round at the same offered load: `aggregated` (4 `--role both` engines, `--backend`),
`disaggregated` (2 prefill + 2 decode engines in vLLM's flow: `--prefill`, `--decode`,
`--disaggregate-above 512`) and, unless `--quick`, `sglang` (the same in SGLang's flow, each
prefill engine's bootstrap server on a port given up front). Each round sends one open-loop
plan, the same to each variant: Poisson arrivals of long prompts (one unique user message of
8k-32k tokens, by Sluice's estimate of 4 characters a token) and short ones (100-300 tokens),
every one streamed with a long answer (200-400 tokens); a nonce leads each prompt, so no
cache helps. The load generator keeps every inter-token gap (`Record.gaps`).

The simulated GPU's timing is coarse on purpose: the sims are Python processes sharing 2 cores
with the proxy and the load generator, and what a token costs them (a step's wake-up, a
chunk's JSON, a write) is CPU whatever the GPU's speed. So a decode step is 10 ms
(`--inter-token-latency 0.01`: ~100 steps/s an engine, each a handful of tokens), and a
prefill chunk of `--max-num-batched-tokens 2048` costs 41 ms (`--prefill-per-token 0.00002`
a prompt word: ~50k words/s, a GPU's order). On an engine that does both, a step carrying a
prompt's chunk is one long gap for every sequence decoding beside it (DistServe's effect:
~50 ms against 10); a decode engine's steps carry no chunk. Offered load: about 1,000 tokens/s
and a few long prompts a second, so the machine stays well under its 2 cores (its busy share is
reported) while every engine's batch is shared. The KV cache (32,768 blocks of 16) holds
every prompt in flight, so Sluice's admission never holds one back for room.

Reported per variant: inter-token gap p50/p99, TTFT p50/p99 of the long prompts, tokens/s
(output tokens over the round, drain included), prefill legs (`sluice_pd_prefill_seconds`'s
count), one-hop and two-hop requests by reason (`sluice_pd_requests_total`), the proxy's
hand-off (`sluice_pd_handoff_seconds`: the bucket bound holding p50 and p99, all rounds), the
decode engines' recomputed prompts and transfers (the sims' /metrics), the machine's busy
share (/proc/stat) and errors. Checked: ITL p99 disaggregated <= 0.5x aggregated and tokens/s
>= 0.9x (both medians of the per-round ratios); hand-off p50 <= 1 ms, p99 <= 3 ms; every
short prompt one hop and no prefill leg but the long prompts'; no disaggregated request
recomputed by its decode engine (a decode engine's recomputes are exactly the one-hop
requests it served whole); no errors. The hand-off is the histogram as Sluice defines it, the
prefill's answer read to the decode's request handed to the kernel (the send's system call
may wake the decode engine, which on 2 shared cores then takes the proxy's core: that wait
is the machine's, not the proxy's, and is not counted).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from load import drive, harness
from load.arrivals import schedule
from load.client import CHAT, Pool, Prepared, encode
from load.harness import Bench, Scenario, Table
from load.processes import MODEL, free_port
from load.stats import by_group, paired_change, percentile, with_range
from load.workloads import Corpus, nonce

LONG_TOKENS = (8_000, 32_000)
SHORT_TOKENS = (100, 300)
ANSWER_TOKENS = (200, 400)
LONG_RATE, SHORT_RATE = 1.5, 2.0  # arrivals a second
THRESHOLD = 512  # --disaggregate-above
SIM_TIMING = (
    "--inter-token-latency", "0.01",
    "--prefill-per-token", "0.00002",
    "--prefill-overhead", "0.005",
    "--max-num-batched-tokens", "2048",
    "--max-num-seqs", "64",
    "--kv-cache-blocks", "32768",
)  # fmt: skip
ITL_RATIO, TOKENS_RATIO = 0.5, 0.9
HANDOFF_P50_S, HANDOFF_P99_S = 0.001, 0.003
COLUMNS = ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "tokens_per_s", "busy_pct")
HANDOFF_BUCKET = 'sluice_pd_handoff_seconds_bucket{le="'
VLLM, SGLANG, AGGREGATED = "disaggregated", "sglang", "aggregated"


@dataclass(frozen=True)
class Variant:
    proxy: str
    decodes: tuple[str, ...]  # the engines whose recompute counters are read
    sims: tuple[str, ...]  # every engine of the variant


async def start(bench: Bench, name: str) -> Variant:
    stack = bench.stack
    if name == AGGREGATED:
        boths = await stack.sims(4, *SIM_TIMING)
        return Variant(await stack.proxy(boths), (), tuple(boths))
    flow = "vllm" if name == VLLM else "sglang"
    # SGLang's bootstrap servers listen on ports told to Sluice up front (`URL=PORT`).
    ports = [free_port() for _ in range(2)] if flow == "sglang" else []
    prefills = [
        await stack.sim("--seed", str(i), "--role", "prefill", "--pd-protocol", flow,
                        *(("--bootstrap-port", str(ports[i])) if ports else ()), *SIM_TIMING)
        for i in range(2)
    ]  # fmt: skip
    decodes = [
        await stack.sim("--seed", str(i + 2), "--role", "decode", "--pd-protocol", flow,
                        *SIM_TIMING)
        for i in range(2)
    ]  # fmt: skip
    flags = ["--pd-protocol", flow, "--disaggregate-above", str(THRESHOLD)]
    for i, url in enumerate(prefills):
        flags += ["--prefill", f"{url}={ports[i]}" if ports else url]
    for url in decodes:
        flags += ["--decode", url]
    return Variant(await stack.proxy([], *flags), tuple(decodes), (*prefills, *decodes))


def plan(seed: str, seconds: float, corpus: Corpus, netloc: str) -> list[tuple[float, Prepared]]:
    """The round's arrivals, long and short interleaved by time, as bytes."""
    rng = random.Random(seed)
    entries: list[tuple[float, Prepared]] = []
    for tag, rate, tokens in (
        ("long", LONG_RATE, LONG_TOKENS),
        ("short", SHORT_RATE, SHORT_TOKENS),
    ):
        for at in schedule("poisson", rate, seconds, rng.randrange(1 << 30)):
            text = f"{nonce(rng)} {corpus.text(rng, rng.randint(*tokens))}"
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": rng.randint(*ANSWER_TOKENS),
                "stream": True,
            }
            data = encode(netloc, "POST", CHAT, json.dumps(body).encode())
            entries.append((at, Prepared(tag, True, data)))
    return sorted(entries, key=lambda entry: entry[0])


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def sim_counts(samples: list[dict[str, float]], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for scrape in samples:
        for key, value in harness.label_values(scrape, name, label).items():
            out[key] = out.get(key, 0.0) + value
    return out


def delta_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


async def scrape_all(variant: Variant) -> tuple[dict[str, float], list[dict[str, float]]]:
    return await harness.scrape(variant.proxy), [await harness.scrape(u) for u in variant.decodes]


def pd_modes(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """{'MODE (REASON)': requests} between two scrapes of the proxy."""
    out: dict[str, float] = {}
    for key, value in after.items():
        if key.startswith("sluice_pd_requests_total{"):
            added = value - before.get(key, 0.0)
            labels = dict(
                p.split("=", 1) for p in key[len("sluice_pd_requests_total{") : -1].split(",")
            )
            mode, reason = labels["mode"].strip('"'), labels["reason"].strip('"')
            name = mode if mode == reason else f"{mode} ({reason})"
            if added:
                out[name] = out.get(name, 0.0) + added
    return out


def handoff_buckets(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        key[len(HANDOFF_BUCKET) : -2]: after[key] - before.get(key, 0.0)
        for key in after
        if key.startswith(HANDOFF_BUCKET)
    }


async def one_round(variant: Variant, items: list[tuple[float, Prepared]]) -> dict[str, Any]:
    proxy0, decode0 = await scrape_all(variant)
    busy0 = busy_jiffies()
    async with Pool(variant.proxy, timeout=300.0) as pool:
        run = await drive.open_loop(pool, items, keep_gaps=True)
    busy1 = busy_jiffies()
    proxy1, decode1 = await scrape_all(variant)
    ok = [r for r in run.records if r.ok]
    gaps = [g for r in ok for g in r.gaps or ()]
    ttft = [r.ttft for r in ok if r.tag == "long" and r.ttft is not None]
    recomputed = "sluice_sim_pd_recomputed_requests_total"
    return {
        "requests": {tag: sum(r.tag == tag for r in run.records) for tag in ("long", "short")},
        "errors": run.errors,
        "error_kinds": sorted({r.error for r in run.records if r.error}),
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) * 1e3,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "tokens_per_s": sum(r.output_tokens for r in ok) / run.seconds,
        "busy_pct": (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1) * 100,
        "prefill_legs": harness.delta(proxy0, proxy1, "sluice_pd_prefill_seconds_count") or 0.0,
        "leg_failures": harness.delta(proxy0, proxy1, "sluice_pd_leg_failures_total") or 0.0,
        "modes": pd_modes(proxy0, proxy1),
        "handoff_buckets": handoff_buckets(proxy0, proxy1),
        "recomputed": delta_counts(
            sim_counts(decode0, recomputed, "reason"), sim_counts(decode1, recomputed, "reason")
        ),
        "transfers": delta_counts(
            sim_counts(decode0, "sluice_sim_pd_transfers_total", "role"),
            sim_counts(decode1, "sluice_sim_pd_transfers_total", "role"),
        ),
    }


def bucket_quantile(buckets: dict[str, float], q: float) -> float | None:
    """The smallest bucket bound holding the q-th percentile of cumulative `buckets`."""
    ordered = sorted((float(le), count) for le, count in buckets.items())
    if not ordered or ordered[-1][1] == 0:
        return None
    return next(le for le, count in ordered if count >= ordered[-1][1] * q / 100)


def pooled(rows: list[dict[str, Any]], variant: str) -> dict[str, Any]:
    """A variant's counts over all rounds."""
    mine = [r for r in rows if r["variant"] == variant]
    sums: dict[str, dict[str, float]] = {}
    for field in ("requests", "modes", "handoff_buckets", "recomputed", "transfers"):
        sums[field] = {}
        for row in mine:
            for key, value in row[field].items():
                sums[field][key] = sums[field].get(key, 0.0) + value
    buckets = sums.pop("handoff_buckets")
    return {
        **sums,
        "prefill_legs": sum(r["prefill_legs"] for r in mine),
        "leg_failures": sum(r["leg_failures"] for r in mine),
        "handoff_p50_ms": _ms(bucket_quantile(buckets, 50)),
        "handoff_p99_ms": _ms(bucket_quantile(buckets, 99)),
        "handoffs": max(buckets.values(), default=0.0),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


async def measure(bench: Bench) -> dict[str, Any]:
    rounds = bench.rounds(1, 3)
    seconds = bench.pick(15.0, 30.0)
    names = [AGGREGATED, VLLM] + ([] if bench.quick else [SGLANG])
    variants = {name: await start(bench, name) for name in names}
    for variant in variants.values():
        for url in (*variant.sims, variant.proxy):
            await harness.wait_healthy(url)
    corpus = Corpus.default()

    async def one(name: str, number: int) -> dict[str, Any]:
        netloc = variants[name].proxy.removeprefix("http://")
        items = plan(f"pd/{number}", seconds, corpus, netloc)
        return await one_round(variants[name], items)

    started = time.perf_counter()
    rows = await bench.alternate(rounds, names, one)
    result: dict[str, Any] = {
        "rounds": rounds,
        "seconds_per_round": seconds,
        "measured_s": round(time.perf_counter() - started, 1),
        "summary": by_group(rows, "variant", COLUMNS),
        "pooled": {name: pooled(rows, name) for name in names},
        "ratios": {
            name: {
                "itl_p99": [
                    1 + c / 100 for c in paired_change(rows, "itl_p99_ms", name, AGGREGATED)
                ],
                "tokens_per_s": [
                    1 + c / 100 for c in paired_change(rows, "tokens_per_s", name, AGGREGATED)
                ],
            }
            for name in names
            if name != AGGREGATED
        },
        "rounds_data": rows,
    }
    result["targets"] = targets(result)
    return result


def targets(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []

    def check(label: str, ok: bool | None) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL' if ok is not None else 'n/a '} {label}")

    pooled_ = result["pooled"]
    for name, ratios in result["ratios"].items():
        itl, tokens = ratios["itl_p99"][0], ratios["tokens_per_s"][0]
        check(f"{name}: ITL p99 {itl:.2f}x aggregated's <= {ITL_RATIO}", itl <= ITL_RATIO)
        check(
            f"{name}: tokens/s {tokens:.2f}x aggregated's >= {TOKENS_RATIO}", tokens >= TOKENS_RATIO
        )
        p50, p99 = pooled_[name]["handoff_p50_ms"], pooled_[name]["handoff_p99_ms"]
        if name == VLLM:
            check(
                f"{name}: hand-off p50 <= {harness.fmt(p50, 2)} ms, p99 <= {harness.fmt(p99, 2)} "
                f"ms (bucket bounds) within {HANDOFF_P50_S * 1e3:g} / {HANDOFF_P99_S * 1e3:g} ms",
                None
                if p50 is None or p99 is None
                else p50 <= HANDOFF_P50_S * 1e3 and p99 <= HANDOFF_P99_S * 1e3,
            )
        sent = pooled_[name]["requests"]
        modes = pooled_[name]["modes"]
        two_hops = modes.get(VLLM, 0.0)
        if name == VLLM:
            short = modes.get("aggregated (short)", 0.0)
            check(
                f"{name}: short prompts one hop {short:.0f} of {sent.get('short', 0):.0f}; "
                f"prefill legs {pooled_[name]['prefill_legs']:.0f} = long prompts "
                f"{sent.get('long', 0):.0f}",
                short == sent.get("short") and pooled_[name]["prefill_legs"] == sent.get("long"),
            )
        one_hop = sum(v for k, v in modes.items() if k.startswith("aggregated"))
        recomputed = sum(pooled_[name]["recomputed"].values())
        taken = pooled_[name]["transfers"].get("decode", 0.0)
        check(
            f"{name}: decode engines recomputed {recomputed:.0f} = one-hop requests "
            f"{one_hop:.0f}, took {taken:.0f} transfers = two-hop requests {two_hops:.0f}",
            recomputed == one_hop
            and taken == two_hops
            and "unusable" not in pooled_[name]["recomputed"],
        )
    errors = sum(s["errors"] for s in result["summary"].values())
    check(f"every request answered whole ({errors:.0f} not)", errors == 0)
    return lines


def ratio(ratios: dict[str, list[float]] | None, name: str) -> str | None:
    """A median ratio over rounds, to two places (0.36x is not 0.4x against a 0.5x target)."""
    return None if ratios is None else f"{ratios[name][0]:.2f}"


def modes_text(modes: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(modes.items(), key=lambda kv: -kv[1])) or "-"


def tables(result: dict[str, Any]) -> list[Table]:
    summary, pooled_ = result["summary"], result["pooled"]
    rows = []
    for name, s in summary.items():
        p = pooled_[name]
        ratios = result["ratios"].get(name)
        handoff = (p["handoff_p50_ms"], p["handoff_p99_ms"])
        rows.append(
            [name, with_range(s, "itl_p50_ms"), with_range(s, "itl_p99_ms"),
             ratio(ratios, "itl_p99"), with_range(s, "ttft_p50_ms"),
             with_range(s, "ttft_p99_ms"), with_range(s, "tokens_per_s"),
             ratio(ratios, "tokens_per_s"), round(p["prefill_legs"]), modes_text(p["modes"]),
             None if None in handoff else "{:.2f} / {:.2f}".format(*handoff),
             round(sum(p["recomputed"].values())), round(p["transfers"].get("decode", 0.0)),
             with_range(s, "busy_pct"), s["errors"]]
        )  # fmt: skip
    long_, short = (pooled_[AGGREGATED]["requests"].get(t, 0) for t in ("long", "short"))
    return [
        Table(
            f"4 simulated GPUs, open loop: {LONG_RATE:g} long prompts/s ({LONG_TOKENS[0] // 1000}k-"
            f"{LONG_TOKENS[1] // 1000}k tokens) and {SHORT_RATE:g} short/s ({SHORT_TOKENS[0]}-"
            f"{SHORT_TOKENS[1]}), {ANSWER_TOKENS[0]}-{ANSWER_TOKENS[1]}-token streamed answers, "
            f"{result['seconds_per_round']:g} s a round ({long_:.0f} long, {short:.0f} short a "
            f"variant in all); medians of {result['rounds']} alternating round(s) (range); ITL: "
            "every inter-token gap; TTFT: long prompts; x agg: over aggregated's in the same "
            "round; hand-off: bucket bounds of p50 / p99, all rounds; busy: the machine's share "
            "of its 2 cores; " + harness.targets_met(result["targets"], "issue 43's"),
            [
                "variant",
                "ITL p50 ms",
                "ITL p99 ms",
                "x agg",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "tokens/s",
                "x agg",
                "prefill legs",
                "hops",
                "hand-off ms",
                "recomputed",
                "transfers",
                "busy %",
                "errors",
            ],
            rows,
        ),
        Table("", ["target"], [[line] for line in result["targets"]]),
    ]


SCENARIO = Scenario(
    name="pd",
    reproduces="issue 43",
    about="2 prefill + 2 decode engines (vLLM's and SGLang's flows) against 4 aggregated",
    reference=(
        "Issue 43's targets: ITL p99 2P+2D <= 0.5x 4 aggregated at the same offered load,\n"
        "tokens/s >= 0.9x; hand-off p50 <= 1 ms, p99 <= 3 ms; short prompts one hop; decode\n"
        "engines recompute nothing they were sent KV for. DistServe (OSDI 2024): a long\n"
        "prefill stalls every decode batched beside it."
    ),
    measure=measure,
    tables=tables,
)
