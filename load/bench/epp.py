"""`python -m load bench epp`: Sluice as Envoy's endpoint picker, beside Envoy alone,
Sluice's own proxy and the GPUs themselves.

The endpoint-picker door (`sluice serve --epp-port`, the Gateway API Inference Extension's
EPP over Envoy's ext_proc) claims the proxy's routing at Envoy's data path: Envoy carries
the bytes, Sluice only says where they go. That holds if, on the same GPUs, Envoy+EPP's
prefix hits match the proxy's, its streams keep up with the GPU, it adds little latency,
and the picker's own work stays small. Four doors before the same simulated GPUs
(load/envoy_stack.py): `direct` (the GPU itself), `envoy` (Envoy's round robin, no
picker), `envoy+epp` (Envoy asking Sluice), `sluice` (Sluice's proxy), taking turns in
alternating rounds; the machine's 2 cores are shared by all, so read ratios within a run.

1. rag (bench routing's workload, 4 GPUs, rate and answers; load/routing_workloads.py),
   fresh GPUs and doors every run: the GPUs' own prefix-cache hits over queries, the
   answers that were not 200. `direct` is left out: a client spreading over the GPUs is
   what `envoy`'s round robin does. Then one streamed rag answer through Envoy+EPP is
   byte-compared with the same asked of the GPU that served it, ids and `created` removed
   (all asked after a first identical request, so that each reports the same cached
   tokens; the GPU asked twice shows that it answers a prompt deterministically).
2. Concurrent 200-token streams on one GPU that streams a token every 20 ms (bench
   streams' GPU and clients): tokens/s, and over direct's; CPU per stream (/proc, the
   process tree) of Sluice in EPP mode (every answer chunk goes through it, as GIE's
   full-duplex mode sends it) against Sluice's proxy mode, and Envoy's.
3. One-token chats at 100 req/s, Poisson arrivals (open loop: no coordinated omission),
   to an instant GPU: p50/p99 latency minus direct's; CPU per request.
4. envoy+epp alone, 100 req/s of unique ~4,096-token prompts on the instant GPU: the
   picker's own time (`sluice_epp_decision_seconds`: the body's last byte in to the
   endpoints out, less rendering, tokenizing and time held for room), its p99 as the
   histogram bucket bound that holds it over the round; tokenizing apart
   (`sluice_tokenize_seconds`, every path), since a proxy pays it too.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from typing import Any

import trio

from load import arrivals, client, drive, harness
from load.bench import routing, streams
from load.client import CHAT
from load.envoy_stack import (
    Target,
    all_answer,
    byte_compare,
    cpu_now,
    cpu_since,
    histogram,
    start_targets,
)
from load.harness import Bench, Scenario, Table
from load.processes import Stack
from load.routing_workloads import MODEL as RAG_MODEL
from load.routing_workloads import body, document
from load.stats import percentile
from load.workloads import Corpus, Request, nonce

RAG_VARIANTS = ("envoy", "envoy+epp", "sluice")
POLICY = ("--policy", "cache_aware")
STREAMS = 200
RATE = 100.0
LONG_TOKENS = 4096
# 100 req/s of 4k tokens is ~400k tokens/s: more than the tokenizer's one thread here does
# (~215-250k on a core), so tokenizing queues; at 25 req/s it keeps up, and the decision's
# time is its own rather than that of a loop beside a saturated tokenizer.
LONG_RATES = (RATE, 25.0)
DECISION = "sluice_epp_decision_seconds"
TOKENIZE = "sluice_tokenize_seconds"
PROMPT_TOKENS = "sluice_prompt_tokens_total"
# The streamed answer compared through Envoy+EPP and straight from the GPU that served it.
COMPARED = body(
    [{"role": "system", "content": document(0, 2000)},
     {"role": "user", "content": "Question 0: how does the prefix cache work?"}],
    routing.MAX_TOKENS,
)  # fmt: skip
RAG_PROBE = {"model": RAG_MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1}
# The targets (the brief of the EPP door): hits, streams, CPU, the decision's own time.
HIT_FLOOR, HIT_GAP = 0.85, 0.02
STREAMS_FLOOR, CPU_CEILING, DECISION_MS = 0.97, 1.5, 1.0


# -- 1. rag on 4 GPUs: prefix hits --------------------------------------------------------


async def rag_part(bench: Bench) -> dict[str, Any]:
    duration = bench.args.duration or bench.pick(5.0, 30.0)
    compare: dict[str, Any] = {}

    async def one(variant: str, number: int) -> dict[str, Any]:
        async with Stack(bench.args.proxy_arg) as stack:
            gpus = await stack.sims(routing.BACKENDS, *routing.SIM_PROFILE, model=RAG_MODEL)
            target = (await start_targets(stack, gpus, POLICY, [variant]))[variant]
            await all_answer({variant: target}, RAG_PROBE)
            before = await harness.scrape(target.sluice) if target.sluice else {}
            # Every variant of a round gets the same requests (the seed is the round's).
            samples = await routing.drive(target.url, "rag", duration, number)
            row = await routing.backend_figures(gpus)
            if target.sluice:
                after = await harness.scrape(target.sluice)
                row.update(
                    await routing.sluice_figures(target.sluice, stack.dashboard(target.sluice))
                )
                if variant == "envoy+epp":
                    row["decision"] = histogram(before, after, DECISION).as_dict()
            if variant == "envoy+epp" and not compare:
                compare.update(await byte_compare(target.url, COMPARED))
        ttft = samples.ttft
        return {
            **row,
            "answered": len(ttft) - samples.censored,
            "errors": samples.errors,  # answers not 200, and connections that failed
            "censored": samples.censored,
            "ttft_mean_ms": sum(ttft) / len(ttft) * 1e3 if ttft else None,
            "ttft_p99_ms": percentile(ttft, 99) * 1e3 if ttft else None,
        }

    # Two rounds: a run's hits hang on where its first requests of each document went.
    runs = await bench.alternate(bench.rounds(1, 2), RAG_VARIANTS, one, " rag")
    return {"duration_s": duration, "rate": routing.RATES["rag"], "runs": runs, "compare": compare}


# -- 2. streams ---------------------------------------------------------------------------


@dataclass
class StreamSums:
    tokens: int = 0
    seconds: float = 0.0
    streams_done: int = 0
    errors: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        per_stream = streams.TOKENS / max(self.tokens, 1) * 1e3  # CPU s -> ms a stream
        return {
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "cpu_ms_per_stream": {role: s * per_stream for role, s in self.cpu.items()},
            "cpu_ms_per_1000_tokens": {
                role: s / max(self.tokens, 1) * 1e6 for role, s in self.cpu.items()
            },
            "gap_p99_ms": percentile(self.gaps, 99) * 1e3 if self.gaps else None,
            "streams_done": self.streams_done,
            "errors": self.errors,
        }


async def stream_round(
    target: Target, count: int, warmup: float, seconds: float, sums: StreamSums
) -> dict[str, Any]:
    """`count` closed-loop streams to `target`; what the window between warm-up and its end
    saw, added to `sums`."""
    request = streams.chat_request(target.url)
    window = streams.Window()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(streams.client_loop, target.url, request, window, stop)
        await trio.sleep(warmup)  # every stream started, their starts spread
        cpu0, started = cpu_now(target), trio.current_time()
        window.open = True
        await trio.sleep(seconds)
        window.open = False
        elapsed, cpu = trio.current_time() - started, cpu_since(target, cpu0)
        stop.set()
        nursery.cancel_scope.cancel()
    sums.tokens += window.tokens
    sums.seconds += elapsed
    sums.streams_done += window.streams_done
    sums.errors += window.errors
    sums.gaps += window.gaps
    for role, spent in cpu.items():
        sums.cpu[role] = sums.cpu.get(role, 0.0) + spent
    return {"tokens_per_s": window.tokens / elapsed, "errors": window.errors}


async def streams_part(bench: Bench) -> dict[str, Any]:
    count = bench.args.streams or bench.pick(50, STREAMS)
    rounds, seconds = bench.rounds(1, 3), bench.pick(4.0, 8.0)
    warmup = bench.pick(2.0, streams.TOKENS * streams.INTER_TOKEN_S + 1.0)
    async with Stack(bench.args.proxy_arg) as stack:
        gpu = await stack.sim(*streams.SIM_FLAGS)
        targets = await start_targets(stack, [gpu], streams.SLUICE_FLAGS)
        await all_answer(targets, client.ONE_TOKEN)
        sums = {name: StreamSums() for name in targets}

        async def one(name: str, _: int) -> dict[str, Any]:
            return await stream_round(targets[name], count, warmup, seconds, sums[name])

        await bench.alternate(rounds, list(targets), one, f" {count} streams")
    return {
        "streams": count,
        "rounds": rounds,
        "seconds_per_round": seconds,
        "targets": {name: s.report() for name, s in sums.items()},
    }


# -- 3. added latency at 100 req/s, and 4. the decision's own time with 4k prompts -------


async def latency_parts(bench: Bench) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rounds, seconds = bench.rounds(1, 4), bench.pick(3.0, 8.0)
    async with Stack(bench.args.proxy_arg) as stack:
        gpu = await stack.sim(instant=True)
        targets = await start_targets(stack, [gpu], ())
        await all_answer(targets, client.ONE_TOKEN)
        pools = {name: client.Pool(t.url) for name, t in targets.items()}
        try:
            for pool in pools.values():
                await pool.warm()
            latency = await latency_rounds(bench, targets, pools, rounds, seconds)
            decision = [
                await decision_round(bench, targets["envoy+epp"], pools["envoy+epp"], rate)
                for rate in LONG_RATES
            ]
        finally:
            for pool in pools.values():
                await pool.close()
    return latency, decision


async def latency_rounds(
    bench: Bench,
    targets: dict[str, Target],
    pools: dict[str, client.Pool],
    rounds: int,
    seconds: float,
) -> dict[str, Any]:
    latencies: dict[str, list[float]] = {name: [] for name in targets}
    errors = dict.fromkeys(targets, 0)
    sent = dict.fromkeys(targets, 0)
    cpu: dict[str, dict[str, float]] = {name: {} for name in targets}
    epp = targets["envoy+epp"]
    assert epp.sluice is not None
    decision_before = await harness.scrape(epp.sluice)

    async def one(name: str, number: int) -> dict[str, Any]:
        target, pool = targets[name], pools[name]
        plan = drive.poisson(pool.prepare(client.ONE_TOKEN_REQUEST), RATE, seconds, number)
        cpu0 = cpu_now(target)
        run = await drive.open_loop(pool, plan)
        for role, spent in cpu_since(target, cpu0).items():
            cpu[name][role] = cpu[name].get(role, 0.0) + spent
        latencies[name] += run.latencies()
        errors[name] += run.errors
        sent[name] += len(run.records)
        return {"errors": run.errors}

    await bench.alternate(rounds, list(targets), one, f" {RATE:g} req/s")
    # Only Envoy+EPP's Sluice decided anything meanwhile: its histogram is this part's.
    decision = histogram(decision_before, await harness.scrape(epp.sluice), DECISION)
    direct = latencies["direct"]
    out: dict[str, Any] = {}
    for name in targets:
        mine = latencies[name]
        out[name] = {
            "p50_ms": percentile(mine, 50) * 1e3,
            "p99_ms": percentile(mine, 99) * 1e3,
            "added_p50_ms": (percentile(mine, 50) - percentile(direct, 50)) * 1e3,
            "added_p99_ms": (percentile(mine, 99) - percentile(direct, 99)) * 1e3,
            "cpu_ms_per_request": {r: s / max(sent[name], 1) * 1e3 for r, s in cpu[name].items()},
            "requests": sent[name],
            "errors": errors[name],
        }
    out["envoy+epp"]["decision"] = decision.as_dict()
    return {"rate": RATE, "rounds": rounds, "seconds_per_round": seconds, "targets": out}


async def decision_round(
    bench: Bench, target: Target, pool: client.Pool, rate: float
) -> dict[str, Any]:
    """Unique ~4k-token prompts at `rate` through Envoy+EPP: the picker's own time, apart
    from tokenizing."""
    seconds = bench.pick(3.0, 15.0)
    # Seeded by the rate: the prompts of one rate are not the L0-cached ones of another.
    rng, corpus = random.Random(f"epp-4k-{rate:g}"), Corpus.default()
    plan: list[tuple[float, drive.Item]] = []
    for at in arrivals.schedule("poisson", rate, seconds, seed=4096):
        # A nonce leads each prompt: no prefix is shared, no tokenizer cache helps.
        text = f"{nonce(rng)} {corpus.text(rng, LONG_TOKENS)}"
        chat = {"model": "sim", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        plan.append((at, pool.prepare(Request(CHAT, chat, "4k"))))
    assert target.sluice is not None
    harness.progress(f"epp: {rate:g} req/s of ~{LONG_TOKENS:,}-token prompts through envoy+epp")
    before, cpu0 = await harness.scrape(target.sluice), cpu_now(target)
    run = await drive.open_loop(pool, plan)
    cpu = cpu_since(target, cpu0)
    after = await harness.scrape(target.sluice)
    harness.progress("")
    tokens = harness.delta(before, after, PROMPT_TOKENS) or 0.0
    latencies = run.latencies()
    return {
        "rate": rate,
        "seconds": seconds,
        "requests": len(run.records),
        "errors": run.errors,
        "prompt_tokens_mean": tokens / max(len(run.records), 1),
        "decision": histogram(before, after, DECISION).as_dict(),
        "tokenize": histogram(before, after, TOKENIZE).as_dict(),
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "cpu_ms_per_request": {r: s / max(len(run.records), 1) * 1e3 for r, s in cpu.items()},
    }


# -- the run, its targets and tables ------------------------------------------------------


async def measure(bench: Bench) -> dict[str, Any]:
    rag = await rag_part(bench)
    streamed = await streams_part(bench)
    latency, decision = await latency_parts(bench)
    result: dict[str, Any] = {"rag": rag, "streams": streamed, "latency": latency}
    result["decision"] = decision
    result["targets"] = targets(result)
    return result


def _mean(runs: list[dict[str, Any]], variant: str, key: str) -> float | None:
    values = [r[key] for r in runs if r["variant"] == variant]
    return sum(values) / len(values) if values else None


def targets(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []

    def check(label: str, ok: bool | None) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL' if ok is not None else 'n/a '} {label}")

    runs = result["rag"]["runs"]
    epp, sluice = _mean(runs, "envoy+epp", "hit_rate"), _mean(runs, "sluice", "hit_rate")
    if epp is not None and sluice is not None:
        check(f"rag: envoy+epp hit rate {epp:.3f} >= {HIT_FLOOR}", epp >= HIT_FLOOR)
        check(
            f"rag: envoy+epp at most {HIT_GAP:.2f} below sluice's {sluice:.3f}",
            epp >= sluice - HIT_GAP,
        )
    bad = sum(r["errors"] + r["censored"] for r in runs if r["variant"] == "envoy+epp")
    check(f"rag: every answer through envoy+epp 200 ({bad} not)", bad == 0)
    compare = result["rag"]["compare"]
    if compare:
        check(
            "a streamed answer through envoy+epp = direct's, ids and created removed",
            bool(compare.get("identical")),
        )
    by = result["streams"]["targets"]
    direct = by["direct"]["tokens_per_s"] or 1.0
    ratio = by["envoy+epp"]["tokens_per_s"] / direct
    check(
        f"streams: envoy+epp {ratio:.3f}x direct's tokens/s >= {STREAMS_FLOOR}",
        ratio >= STREAMS_FLOOR,
    )
    as_epp, as_proxy = (by[n]["cpu_ms_per_stream"]["sluice"] for n in ("envoy+epp", "sluice"))
    cpu = as_epp / as_proxy
    check(
        f"streams: Sluice's CPU a stream as EPP {cpu:.2f}x as proxy <= {CPU_CEILING}",
        cpu <= CPU_CEILING,
    )
    p99 = result["decision"][0]["decision"]["p99_le_ms"]
    check(
        f"4k prompts at {RATE:g} req/s: decision p99 <= {p99:g} ms <= {DECISION_MS:g} ms",
        p99 <= DECISION_MS,
    )
    return lines


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


def routes(reasons: dict[str, float] | None) -> str | None:
    """Sluice's route reasons, most taken first: `prefix 310, load 50`."""
    if not reasons:
        return None
    ordered = sorted(reasons.items(), key=lambda item: -item[1])
    return ", ".join(f"{reason} {count:.0f}" for reason, count in ordered)


def tables(result: dict[str, Any]) -> list[Table]:
    rag, st, lat, dec = (result[k] for k in ("rag", "streams", "latency", "decision"))
    compare = rag["compare"]
    said = "not run"
    if compare and "error" in compare:
        said = compare["error"]
    elif compare:
        said = (
            f"{compare['bytes']:,} bytes, identical: {harness.fmt(compare['identical'])}, same "
            f"text: {harness.fmt(compare['same_text'])}, same GPU: "
            f"{harness.fmt(compare['same_gpu'])}, GPU deterministic: "
            f"{harness.fmt(compare['deterministic'])}"
        )
    rag_rows = [
        [r["variant"], r["round"], r["answered"], r["errors"] + r["censored"], r["hit_rate"],
         _whole(r["ttft_mean_ms"]), _whole(r["ttft_p99_ms"]),
         f"{r['busiest_share']:.2f} ({r['busiest_vs_mean']:.2f}x)",
         f"{r['predicted_hit']:.3f}/{r['reported_hit']:.3f}" if "predicted_hit" in r else None,
         routes(r.get("reasons")), (r.get("decision") or {}).get("p99_le_ms")]
        for r in rag["runs"]
    ]  # fmt: skip
    direct = st["targets"]["direct"]["tokens_per_s"] or 1.0
    proxy_cpu = st["targets"]["sluice"]["cpu_ms_per_stream"].get("sluice")
    stream_rows = []
    for name, r in st["targets"].items():
        sluice = r["cpu_ms_per_stream"].get("sluice")
        versus = sluice / proxy_cpu if sluice is not None and proxy_cpu else None
        stream_rows.append(
            [name, r["tokens_per_s"], r["tokens_per_s"] / direct, sluice, versus,
             r["cpu_ms_per_stream"].get("envoy"), r["cpu_ms_per_1000_tokens"].get("sluice"),
             r["gap_p99_ms"], r["errors"]]
        )  # fmt: skip
    latency_rows = [
        [name, r["p50_ms"], r["p99_ms"], r["added_p50_ms"], r["added_p99_ms"],
         r["cpu_ms_per_request"].get("sluice"), r["cpu_ms_per_request"].get("envoy"),
         (r.get("decision") or {}).get("p99_le_ms"), r["errors"]]
        for name, r in lat["targets"].items()
    ]  # fmt: skip
    long_rows = [
        [r["rate"], r["requests"], r["errors"], r["prompt_tokens_mean"], r["decision"]["mean_ms"],
         r["decision"]["p99_le_ms"], r["tokenize"]["mean_ms"], r["tokenize"]["p99_le_ms"],
         r["p50_ms"], r["p99_ms"], r["cpu_ms_per_request"].get("sluice"),
         r["cpu_ms_per_request"].get("envoy")]
        for r in dec
    ]  # fmt: skip
    return [
        Table(
            f"1. rag on {routing.BACKENDS} simulated GPUs (bench routing's), {rag['duration_s']:g}"
            f" s at {rag['rate']:g}/s a run, fresh GPUs and doors each; hit rate: the GPUs' own "
            "prefix-cache hits over queries; not 200: answers not 200, failed or unfinished; "
            "predicted/reported: Sluice's cache_aware's; decision p99 <=: the EPP's histogram "
            f"bucket; a streamed answer through envoy+epp against the GPU's own: {said}; "
            + harness.targets_met(result["targets"], "the EPP door's"),
            ["door", "round", "answered", "not 200", "hit rate", "TTFT mean ms", "TTFT p99 ms",
             "busiest share", "predicted/reported", "routes", "decision p99 <= ms"],
            rag_rows,
            digits=3,
        ),
        Table(
            f"2. {st['streams']} concurrent 200-token streams, one GPU at 20 ms a token, "
            f"{st['rounds']} alternating round(s) of {st['seconds_per_round']:g} s; CPU: ms a "
            "stream (/proc, process tree); x proxy: Sluice's CPU over its proxy mode's",
            ["door", "tokens/s", "x direct", "Sluice CPU ms/stream", "x proxy",
             "Envoy CPU ms/stream", "Sluice ms/1k tok", "gap p99 ms", "errors"],
            stream_rows,
            digits=2,
        ),
        Table(
            f"3. one-token chats at {lat['rate']:g} req/s (Poisson), an instant GPU, "
            f"{lat['rounds']} alternating round(s) of {lat['seconds_per_round']:g} s; added: "
            "minus direct's; CPU ms a request",
            ["door", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "Sluice CPU",
             "Envoy CPU", "decision p99 <= ms", "errors"],
            latency_rows,
            digits=2,
        ),
        Table(
            f"4. envoy+epp alone on the instant GPU, unique ~{LONG_TOKENS:,}-token prompts (a "
            f"nonce first) for {dec[0]['seconds']:g} s a rate; tokens: as Sluice counted them; "
            "decision: the picker's own time, less rendering, tokenizing and time held; p99 <=: "
            "the bucket bound holding it; tokenize: every path, a thread's queue included; "
            "CPU ms a request",
            ["req/s", "requests", "errors", "tokens", "decision mean ms", "decision p99 <= ms",
             "tokenize mean ms", "tokenize p99 <= ms", "e2e p50 ms", "e2e p99 ms", "Sluice CPU",
             "Envoy CPU"],
            long_rows,
            digits=2,
        ),
        Table("the EPP door's targets", ["check"], [[line] for line in result["targets"]]),
    ]  # fmt: skip


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--streams", type=harness.at_least_one, help=f"concurrent streams ({STREAMS}; --quick 50)"
    )
    parser.add_argument(
        "--duration", type=float, help="seconds of rag arrivals a run (30; --quick 5)"
    )


SCENARIO = Scenario(
    name="epp",
    reproduces="the EPP door",
    about="Envoy + Sluice's endpoint picker vs Envoy, Sluice, direct: hits, streams, latency",
    reference=(
        "Targets: rag through Envoy+EPP hit rate >= 0.85 and within 0.02 of Sluice's proxy,\n"
        "every answer 200, a streamed answer the GPU's own; 200 streams >= 0.97x direct's\n"
        "tokens/s with Sluice's CPU a stream as EPP <= 1.5x as proxy; the decision's p99\n"
        "<= 1 ms at 100 req/s of 4k-token prompts (tokenizing apart)."
    ),
    measure=measure,
    tables=tables,
    options=options,
)
