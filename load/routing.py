"""Routing side by side: Sluice's policies and SMG's cache_aware in front of 4 simulated GPUs.

For each workload (rag, hot, chat: routing_workloads.py) and each variant (Sluice with
`--policy cache_aware | round_robin | power_of_two`, and SMG `--policy cache_aware`), four
fresh `sluice sim-backend` processes and the router under test start as separate processes;
the same seeded open-loop stream of streaming chat requests goes through the router, then
the backends' own counters are read. Variants alternate order from round to round (these
machines are noisy). Reported per variant: the prefix-cache hit rate from the backends'
`vllm:prefix_cache_hits / vllm:prefix_cache_queries`, mean and p99 time to first token, the
busiest backend's share of requests (and that share against the mean), and for Sluice's
cache_aware its predicted vs the backends' reported hit and its index size.

The simulated GPUs are llm-d-inference-sim's "7-8B on H100" row (prefill 30 ms + 0.15 ms a
token, 10 ms a decode step, twice that at a full batch), with vLLM's token budget (2048), 8
sequences at once and a KV cache of 448 blocks of 16 tokens: about three of the 2,000-token
system prompts per GPU, so that no GPU can hold every prefix and where a request goes
matters, as on a real fleet whose prompts outgrow one GPU's cache.

    python -m load routing [--workloads rag,hot,chat] [--duration 45] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from load.processes import free_port, start_process, stop_all
from load.routing_workloads import WORKLOADS, Arrival, Conversations, body, static_plan
from load.stats import percentile

BACKENDS = 4
SIM_PROFILE = (
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "2048",
    "--prefill-overhead", "0.030",
    "--prefill-per-token", "0.00015",
    "--inter-token-latency", "0.010",
    "--time-factor-under-load", "2.0",
    "--kv-cache-blocks", "448",
)  # fmt: skip
RATES = {"rag": 12.0, "hot": 24.0, "chat": 8.0}
MAX_TOKENS = {"rag": 32, "hot": 32, "chat": 32}
CHAT_CONVERSATIONS = 32
SLUICE_VARIANTS = ("cache_aware", "round_robin", "power_of_two")
MAX_OUTSTANDING = 1024
DRAIN_SECONDS = 60.0


@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    censored: int = 0  # no first token by the end of the drain: counted at their wait so far


async def _stream(
    client: httpx.AsyncClient, url: str, request: dict[str, Any], samples: Samples
) -> str | None:
    """Send one streaming request; record its time to first token; return the answer text."""
    started = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=request) as response:
            if response.status_code != 200:
                await response.aread()
                samples.errors += 1
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - started
                    samples.ttft.append(first)
                for choice in json.loads(line[6:]).get("choices", []):
                    pieces.append(choice.get("delta", {}).get("content") or "")
    except httpx.HTTPError:
        samples.errors += 1
        return None
    except trio.Cancelled:
        if first is None:
            samples.censored += 1
            samples.ttft.append(time.perf_counter() - started)
        raise
    return "".join(pieces)


async def drive(url: str, workload: str, duration: float, seed: int) -> Samples:
    samples = Samples()
    limits = httpx.Limits(max_connections=MAX_OUTSTANDING, max_keepalive_connections=256)
    timeout = httpx.Timeout(DRAIN_SECONDS + duration, connect=10)
    conversations = Conversations(CHAT_CONVERSATIONS, seed) if workload == "chat" else None
    rate = RATES[workload]
    if conversations is None:
        plan = static_plan(workload, rate, duration, seed)
    else:  # chat's messages depend on earlier answers: only the times are planned
        plan = [a for a in static_plan("rag", rate, duration, seed)]
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        start = trio.current_time()
        with trio.move_on_after(duration + DRAIN_SECONDS):
            async with trio.open_nursery() as nursery:
                for arrival in plan:
                    await trio.sleep_until(start + arrival.at)
                    if conversations is None:
                        nursery.start_soon(_one, client, url, arrival, workload, samples, None)
                        continue
                    turn = conversations.next()
                    if turn is not None:
                        number, messages = turn
                        chat = Arrival(arrival.at, number, messages)
                        nursery.start_soon(
                            _one, client, url, chat, workload, samples, conversations
                        )
    return samples


async def _one(
    client: httpx.AsyncClient,
    url: str,
    arrival: Arrival,
    workload: str,
    samples: Samples,
    conversations: Conversations | None,
) -> None:
    answer = await _stream(client, url, body(arrival.messages, MAX_TOKENS[workload]), samples)
    if conversations is not None and arrival.conversation is not None:
        conversations.answered(arrival.conversation, answer)


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def backend_figures(client: httpx.AsyncClient, sims: list[str]) -> dict[str, Any]:
    hits = queries = 0.0
    requests: list[int] = []
    for sim in sims:
        text = (await client.get(sim + "/metrics")).text
        hits += _metric(text, "vllm:prefix_cache_hits_total")
        queries += _metric(text, "vllm:prefix_cache_queries_total")
        state = (await client.get(sim + "/sim/state")).json()
        requests.append(sum(state["prompts_by_form"].values()))
    total = sum(requests) or 1
    busiest = max(requests) / total
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "requests_per_backend": requests,
        "busiest_share": busiest,
        "busiest_vs_mean": busiest * len(sims),
    }


async def start_sluice(
    procs: list[subprocess.Popen[bytes]], sims: list[str], policy: str, extra: list[str]
) -> tuple[str, str]:
    dashboard_port = free_port()
    args = ["serve", "--port", "0", "--dashboard-port", str(dashboard_port)]
    args += ["--log-level", "warning", *extra]
    for sim in sims:
        args += ["--backend", sim]
    proxy = await start_process([*args, "--policy", policy], "Sluice proxy", procs)
    return proxy, f"http://127.0.0.1:{dashboard_port}"


async def start_smg(procs: list[subprocess.Popen[bytes]], sims: list[str], smg: str) -> str:
    port = free_port()
    command = [smg, "launch", "--worker-urls", *sims, "--policy", "cache_aware"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=2, trust_env=False) as client:
        with trio.fail_after(60):
            while True:
                try:
                    workers = (await client.get(url + "/workers")).json().get("workers", [])
                    if sum(1 for w in workers if w.get("is_healthy")) == len(sims):
                        return url
                except (httpx.HTTPError, ValueError):
                    pass
                await trio.sleep(0.2)


async def run_variant(workload: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        sims = [
            await start_process(
                ["sim-backend", "--port", "0", "--seed", str(i), *SIM_PROFILE],
                b"Simulated backend",
                procs,
            )
            for i in range(BACKENDS)
        ]
        dashboard = None
        if variant == "smg":
            url = await start_smg(procs, sims, args.smg)
        else:
            url, dashboard = await start_sluice(procs, sims, variant, args.proxy_arg)
        samples = await drive(url, workload, args.duration, args.seed)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            result = await backend_figures(client, sims)
            if dashboard is not None:
                snapshot = (await client.get(dashboard + "/api/snapshot")).json()
                cache_aware = snapshot["routing"].get("cache_aware")
                if cache_aware is not None:
                    prediction = cache_aware["prediction"]
                    result["predicted_hit"] = prediction["mean_predicted_hit"]
                    result["reported_hit"] = prediction["mean_reported_hit"]
                    result["outcomes"] = prediction["outcomes"]
                    result["index_blocks"] = cache_aware["index"]["blocks"]
                    result["index_max_blocks"] = cache_aware["index"]["max_blocks"]
                metrics = (await client.get(url + "/metrics")).text
                result["reasons"] = {
                    line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                    for line in metrics.splitlines()
                    if line.startswith("sluice_route_decisions_total{")
                }
    finally:
        stop_all(procs)
    ms = 1000.0
    result.update(
        {
            "workload": workload,
            "variant": variant,
            "answered": len(samples.ttft) - samples.censored,
            "errors": samples.errors,
            "censored": samples.censored,
            "ttft_mean_ms": sum(samples.ttft) / len(samples.ttft) * ms if samples.ttft else 0.0,
            "ttft_p99_ms": percentile(samples.ttft, 99) * ms,
        }
    )
    return result


def _row(r: dict[str, Any]) -> str:
    predicted = f"{r['predicted_hit']:.3f}/{r['reported_hit']:.3f}" if "predicted_hit" in r else "-"
    index = f"{r['index_blocks']}/{r['index_max_blocks']}" if "index_blocks" in r else "-"
    return (
        f"| {r['workload']} | {r['variant']} | {r['answered']} | {r['errors'] + r['censored']} "
        f"| {r['hit_rate']:.3f} | {r['ttft_mean_ms']:.0f} | {r['ttft_p99_ms']:.0f} "
        f"| {r['busiest_share']:.2f} ({r['busiest_vs_mean']:.2f}x) | {predicted} | {index} |"
    )


def targets(results: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, checked on the mean of the rounds."""

    def mean(workload: str, variant: str, key: str) -> float | None:
        values = [r[key] for r in results if (r["workload"], r["variant"]) == (workload, variant)]
        return sum(values) / len(values) if values else None

    lines: list[str] = []

    def check(label: str, ok: bool | None) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL' if ok is not None else 'n/a '} {label}")

    rag, rag_rr, rag_smg = (
        mean("rag", v, "hit_rate") for v in ("cache_aware", "round_robin", "smg")
    )
    if rag is not None:
        check(f"rag hit rate {rag:.3f} >= 0.88", rag >= 0.88)
        check(
            f"rag hit rate >= round_robin {rag_rr} + 0.15",
            None if rag_rr is None else rag >= rag_rr + 0.15,
        )
        check(
            f"rag hit rate >= smg {rag_smg} - 0.01",
            None if rag_smg is None else rag >= rag_smg - 0.01,
        )
    hot, hot_rr = mean("hot", "cache_aware", "hit_rate"), mean("hot", "round_robin", "hit_rate")
    if hot is not None:
        check(
            f"hot hit rate {hot:.3f} >= round_robin {hot_rr} + 0.05",
            None if hot_rr is None else hot >= hot_rr + 0.05,
        )
        p99, p99_rr, p99_smg = (
            mean("hot", v, "ttft_p99_ms") for v in ("cache_aware", "round_robin", "smg")
        )
        assert p99 is not None
        check(
            f"hot p99 TTFT {p99:.0f} ms <= round_robin {p99_rr}",
            None if p99_rr is None else p99 <= p99_rr,
        )
        check(f"hot p99 TTFT <= smg {p99_smg} / 2", None if p99_smg is None else 2 * p99 <= p99_smg)
        busiest = mean("hot", "cache_aware", "busiest_vs_mean")
        assert busiest is not None
        check(f"hot busiest backend {busiest:.2f}x the mean <= 1.5x", busiest <= 1.5)
    for r in results:
        if "index_blocks" in r:
            check(
                f"{r['workload']} index {r['index_blocks']} <= {r['index_max_blocks']} blocks",
                r["index_blocks"] <= r["index_max_blocks"],
            )
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--variants", default=",".join((*SLUICE_VARIANTS, "smg")))
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per run")
    parser.add_argument("--rounds", type=int, default=1, help="runs per variant, alternating order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smg",
        default=shutil.which("smg") or "/tmp/venv-smg/bin/smg",
        help="the smg executable (skipped when missing)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--proxy-arg", action="append", default=[], help="extra flag for `sluice serve`"
    )


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    variants = [v for v in args.variants.split(",") if v]
    results: list[dict[str, Any]] = []
    for workload in args.workloads.split(","):
        for round_number in range(args.rounds):
            order = variants if round_number % 2 == 0 else variants[::-1]
            for variant in order:
                result = await run_variant(workload, variant, args)
                print(_row(result), result.get("reasons", ""), flush=True)
                results.append(result)
    return results


def main(args: argparse.Namespace) -> None:
    if "smg" in args.variants.split(",") and not Path(args.smg).exists():
        print(f"smg not found at {args.smg}: skipping the SMG variant", file=sys.stderr)
        args.variants = ",".join(v for v in args.variants.split(",") if v != "smg")
    print(
        "| workload | variant | answered | errors | hit rate | TTFT mean ms | TTFT p99 ms "
        "| busiest share | predicted/reported hit | index blocks |",
        flush=True,
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    results = trio.run(run, args)
    for line in targets(results):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
