"""`python -m load bench lora`: LoRA adapters routed by affinity and loaded on demand (issue 44,
part 3), on simulated GPUs as separate processes.

A. Affinity beside plain traffic. Four fresh simulated GPUs (the routing bench's profile)
   with `--max-loras 2` and the same 8 adapters registered on each (`--lora-modules`: listed
   by every engine, 2 kept in memory, as vLLM's `--max-cpu-loras` defaults), Sluice in
   front. Two variants on fresh processes, alternating, with the same requests: the rag
   workload, and on top short requests, which name the 8 adapters in `adapters` and the base
   model in `base` (so the two differ in where adapters send those requests, not in load).
   Reported: the plain requests' prefix-hit rate (their answers' cached over prompt tokens),
   the adapter requests that found their adapter in their engine's memory (1 - the engines'
   `sim:lora_reloads_total` over their `sim:lora_requests_total`: a step that runs an
   adapter not in memory reloads it, once for all its requests in that step), and Sluice's
   affinity tiers (`sluice_lora_routes_total`).
B. On demand. Four fresh GPUs with `--max-loras 2` and no adapter; Sluice with
   `--lora-load-on-demand` and a fleet file naming 12 adapters. 50 concurrent first requests
   for one adapter: the engines' `sim:lora_loads_total` (one load wanted), all answered. Then
   rounds over all 12 adapters (more than the fleet's 8 slots), each adapter's requests
   concurrent: loads and unloads (Sluice's counters), all answered.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

import trio

from load import harness
from load.bench.routing import BACKENDS, SIM_PROFILE
from load.client import Pool
from load.harness import Bench, Scenario, Table
from load.processes import Stack
from load.routing_workloads import MODEL, question, static_plan

ADAPTERS = tuple(f"adapter-{n}" for n in range(8))
ON_DEMAND = tuple(f"tuned-{n}" for n in range(12))
LORA_FLAGS = ("--max-loras", "2", "--lora-load-time", "0.2")
RAG_RATE = 12.0
ADAPTER_RATE = 8.0
MAX_TOKENS = 16
FIRST_REQUESTS = 50
ROTATION_CONCURRENT = 8
CHAT = "/v1/chat/completions"
SEED = 0  # the rag requests and adapter arrivals are the same in every run


def chat(model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": MAX_TOKENS}


async def ask(pool: Pool, body: dict[str, Any]) -> dict[str, Any] | None:
    """One non-streaming chat; its answer, or None when it failed."""
    try:
        reply = await pool.call("POST", CHAT, json_body=body)
    except Exception:  # a failed request is counted, whatever the failure
        return None
    return reply.json() if reply.status == 200 else None


async def affinity_run(bench: Bench, variant: str, duration: float) -> dict[str, Any]:
    modules = [flag for name in ADAPTERS for flag in ("--lora-modules", f"{name}=/l/{name}")]
    async with Stack(bench.args.proxy_arg) as stack:
        sims = await stack.sims(BACKENDS, *SIM_PROFILE, *LORA_FLAGS, *modules, model=MODEL)
        url = await stack.proxy(sims)
        await harness.wait_healthy(url)
        plain = {"prompt": 0, "cached": 0, "answered": 0, "failed": 0}
        adapter_answers = [0, 0]  # answered, failed
        rng = random.Random(f"lora-{SEED}")
        adapter_plan = []
        at = rng.expovariate(ADAPTER_RATE)
        while at < duration:
            adapter = rng.choice(ADAPTERS)
            adapter_plan.append((at, adapter if variant == "adapters" else MODEL, question(rng)))
            at += rng.expovariate(ADAPTER_RATE)

        async def one_plain(messages: list[dict[str, str]]) -> None:
            answer = await ask(pool, chat(MODEL, messages))
            if answer is None:
                plain["failed"] += 1
                return
            usage = answer["usage"]
            plain["answered"] += 1
            plain["prompt"] += usage["prompt_tokens"]
            plain["cached"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

        async def one_adapter(adapter: str, text: str) -> None:
            answer = await ask(pool, chat(adapter, [{"role": "user", "content": text}]))
            adapter_answers[answer is None] += 1

        async with Pool(url, limit=1024) as pool:
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for arrival in static_plan("rag", RAG_RATE, duration, SEED):
                    nursery.start_soon(_at, start + arrival.at, one_plain, arrival.messages)
                for at, adapter, text in adapter_plan:
                    nursery.start_soon(_at, start + at, one_adapter, adapter, text)
        engines = [await harness.scrape(sim) for sim in sims]
        sluice = await harness.scrape(url)
    lora_requests = sum(harness.metric(e, "sim:lora_requests_total") or 0 for e in engines)
    reloads = sum(harness.metric(e, "sim:lora_reloads_total") or 0 for e in engines)
    return {
        "plain_answered": plain["answered"],
        "plain_failed": plain["failed"],
        "plain_hit_rate": plain["cached"] / plain["prompt"] if plain["prompt"] else 0.0,
        "adapter_answered": adapter_answers[0],
        "adapter_failed": adapter_answers[1],
        "adapter_requests_engines": lora_requests,
        "reloads": reloads,
        "landed_in_memory": 1 - reloads / lora_requests if lora_requests else None,
        "tiers": harness.label_values(sluice, "sluice_lora_routes_total", "tier"),
    }


async def _at(when: float, job: Any, *args: Any) -> None:
    await trio.sleep_until(when)
    await job(*args)


async def on_demand(bench: Bench, rotations: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        fleet = Path(folder) / "fleet.toml"
        lines = [f'"{name}" = "/l/{name}"' for name in ON_DEMAND]
        fleet.write_text("[adapters]\n" + "\n".join(lines) + "\n")
        async with Stack(bench.args.proxy_arg) as stack:
            sims = await stack.sims(BACKENDS, *SIM_PROFILE, *LORA_FLAGS, model=MODEL)
            url = await stack.proxy(sims, "--config", str(fleet), "--lora-load-on-demand")
            await harness.wait_healthy(url)
            async with Pool(url, limit=1024) as pool:
                first = await _concurrently(pool, ON_DEMAND[0], FIRST_REQUESTS)
                first_loads = await engine_loads(sims)
                rotation = [0, 0]
                for _ in range(rotations):
                    for adapter in ON_DEMAND:
                        answered = await _concurrently(pool, adapter, ROTATION_CONCURRENT)
                        rotation[0] += answered
                        rotation[1] += ROTATION_CONCURRENT - answered
            sluice = await harness.scrape(url)
            loads = await engine_loads(sims)
    return {
        "first_requests": FIRST_REQUESTS,
        "first_answered": first,
        "first_loads": first_loads,
        "rotations": rotations,
        "rotation_answered": rotation[0],
        "rotation_failed": rotation[1],
        "engine_loads": loads,
        "loads": harness.label_values(sluice, "sluice_lora_loads_total", "outcome"),
        "unloads": harness.label_values(sluice, "sluice_lora_unloads_total", "outcome"),
    }


async def engine_loads(sims: list[str]) -> float:
    """Adapter loads the engines counted (`sim:lora_loads_total`), all of them."""
    total = 0.0
    for sim in sims:
        total += harness.metric(await harness.scrape(sim), "sim:lora_loads_total") or 0.0
    return total


async def _concurrently(pool: Pool, adapter: str, count: int) -> int:
    """`count` requests for `adapter` at once: how many were answered."""
    answered = [0]
    rng = random.Random(adapter)

    async def one() -> None:
        text = question(rng)
        answer = await ask(pool, chat(adapter, [{"role": "user", "content": text}]))
        answered[0] += answer is not None

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return answered[0]


async def measure(bench: Bench) -> dict[str, Any]:
    duration = bench.args.duration or bench.pick(8.0, 30.0)

    async def one(variant: str, _: int) -> dict[str, Any]:
        return await affinity_run(bench, variant, duration)

    runs = await bench.alternate(bench.rounds(1, 2), ("base", "adapters"), one, " affinity")
    demand = await on_demand(bench, bench.pick(1, 3))
    return {
        "duration_s": duration,
        "runs": runs,
        "on_demand": demand,
        "targets": targets(runs, demand),
    }


def _mean(runs: list[dict[str, Any]], variant: str, key: str) -> float:
    values = [r[key] for r in runs if r["variant"] == variant and r[key] is not None]
    return sum(values) / len(values) if values else 0.0


def targets(runs: list[dict[str, Any]], demand: dict[str, Any]) -> list[str]:
    lines: list[str] = []

    def check(label: str, ok: bool) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'} {label}")

    landed = _mean(runs, "adapters", "landed_in_memory")
    check(f"adapter requests on an engine holding the adapter {landed:.3f} >= 0.95", landed >= 0.95)
    plain, beside = (
        _mean(runs, "base", "plain_hit_rate"),
        _mean(runs, "adapters", "plain_hit_rate"),
    )
    check(f"rag prefix-hit of plain requests {beside:.3f} with adapters >= {plain:.3f} without",
          beside >= plain)  # fmt: skip
    failed = sum(r["plain_failed"] + r["adapter_failed"] for r in runs)
    check(f"affinity runs: every request answered ({failed} failed)", failed == 0)
    first_ok = demand["first_loads"] == 1 and demand["first_answered"] == FIRST_REQUESTS
    check(f"{FIRST_REQUESTS} concurrent first requests: {demand['first_loads']:g} load(s), "
          f"{demand['first_answered']} answered", first_ok)  # fmt: skip
    check(f"rotation over {len(ON_DEMAND)} adapters on 8 slots: {demand['rotation_failed']} "
          "failed", demand["rotation_failed"] == 0)  # fmt: skip
    return lines


def summary(result: dict[str, Any]) -> list[list[Any]]:
    """One row per part: the affinity variants over their rounds, then the on-demand runs."""
    runs, demand = result["runs"], result["on_demand"]
    rows = []
    for variant in ("base", "adapters"):
        mine = [r for r in runs if r["variant"] == variant]
        answered = sum(r["plain_answered"] + r["adapter_answered"] for r in mine)
        failed = sum(r["plain_failed"] + r["adapter_failed"] for r in mine)
        landed = _mean(runs, variant, "landed_in_memory") if variant == "adapters" else None
        rows.append(
            [f"affinity: {variant}", answered, failed, _mean(runs, variant, "plain_hit_rate"),
             "-" if landed is None else f"{landed:.3f}", "-", "-"]
        )  # fmt: skip
    loads, unloads = demand["loads"], demand["unloads"]
    rows.append(
        [f"on demand: {FIRST_REQUESTS} first requests at once", demand["first_answered"],
         FIRST_REQUESTS - demand["first_answered"], "-", "-", f"{demand['first_loads']:g}", "-"]
    )  # fmt: skip
    rows.append(
        [f"on demand: {demand['rotations']} x {len(ON_DEMAND)} adapters, "
         f"{ROTATION_CONCURRENT} at once", demand["rotation_answered"], demand["rotation_failed"],
         "-", "-", f"{loads.get('loaded', 0):g} ({loads.get('failed', 0):g} failed)",
         f"{unloads.get('unloaded', 0):g}"]
    )  # fmt: skip
    return rows


def tables(result: dict[str, Any]) -> list[Table]:
    rows = [
        [r["variant"], r["round"], r["plain_answered"], r["plain_failed"], r["plain_hit_rate"],
         r["adapter_answered"], r["adapter_failed"], "-" if r["landed_in_memory"] is None
         else f"{r['landed_in_memory']:.3f}", f"{r['reloads']:g}",
         ", ".join(f"{k} {v:g}" for k, v in sorted(r["tiers"].items())) or "-"]
        for r in result["runs"]
    ]  # fmt: skip
    rounds = max((r["round"] for r in result["runs"]), default=0)
    return [
        Table(
            f"4 simulated GPUs with --max-loras 2; affinity: {result['duration_s']:g} s of rag "
            f"at {RAG_RATE:g}/s, plus {ADAPTER_RATE:g}/s over {len(ADAPTERS)} adapters in "
            f"`adapters` (naming the base model in `base`), {rounds} round(s); in memory: "
            "adapter requests whose engine held the adapter (1 - reloads / adapter requests); "
            "on demand: 12 adapters in the fleet "
            "file, loads the engines counted (first) or Sluice asked (rotation); "
            + harness.targets_met(result["targets"], "issue 44's LoRA"),
            ["part", "answered", "failed", "plain hit rate", "in memory", "loads", "unloads"],
            summary(result),
            digits=3,
        ),
        Table(
            "affinity, each run; Sluice's tiers: the best affinity tier among engines with room",
            ["variant", "round", "plain answered", "failed", "plain hit rate",
             "adapter answered", "failed", "in memory", "reloads", "Sluice's tiers"],
            rows,
            digits=3,
        ),
        Table("issue 44's LoRA targets", ["check"], [[line] for line in result["targets"]]),
    ]  # fmt: skip


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, help="seconds of each affinity run (30)")


SCENARIO = Scenario(
    name="lora",
    reproduces="issue 44",
    about="LoRA adapters: affinity on 4 simulated GPUs beside plain rag; loads on demand",
    reference=(
        "issue 44 targets: 8 adapters over 4 engines with max_lora 2: >= 95% of adapter\n"
        "requests on an engine that has the adapter loaded; 50 concurrent first requests for\n"
        "a new adapter -> one load, all answered; plain rag prefix-hit no lower than without."
    ),
    measure=measure,
    tables=tables,
    options=options,
)
