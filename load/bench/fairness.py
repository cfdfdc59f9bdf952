"""`python -m load bench fairness`: one API key's flood beside another's trickle on saturated
simulated GPUs (issue 32, part 6).

GPUs of 4 sequences (50-100 output tokens at 20 ms a token, llm-d's "7-8B on H100" prefill,
no slow-down at a full batch of 4: streams of 1-2 s), two keys of equal weight, `light` and
`heavy` (`Authorization: Bearer sk-light` / `sk-heavy`: without a keys file each bearer token
is its own tenant). Variants, taking turns: `sluice` (default flags); `fcfs`, the behaviour
before admission knew keys: `--policy round_robin --max-inflight-per-backend 4`, its clients
sending no key (with keys the gate orders even a fixed cap's queue fairly: the reference is
one tenant, first come first served, as the old `SlotQueue`); `capped` (`--variants`): the
cap with keys.

A: one GPU per variant; the light key's closed-loop client alone, then beside the heavy
key's 32 (started 3 s before); each proxy primed once (16 requests at once: the GPU queues,
Sluice learns its room), so rounds measure the steady state. S (issue 40): as A, on GPUs
and proxies of their own (4 sequences, the simulated engine's own prefill), with streams of
16 tokens at 20 ms a token (~0.3 s, shorter than the 0.5 s between two reads of an engine's
metrics). B and C, on a fleet of 4 GPUs at 2x its capacity, are
load/fairness_fleet.py's, as is B's series of the proxy's saturation gauge (issue 44: it
rises with the offered load and falls after). Every request must be answered 200, or 429
with Retry-After: anything else is lost.

Each part runs through both doors (`--door proxy|epp|both`, load/doors.py): Sluice's proxy,
and Envoy with the same Sluice flags as its endpoint picker (`sluice:epp`, `fcfs:epp`: a GPU
and a door of their own); the targets are checked door by door.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import trio

from load import client, drive, harness
from load.client import Pool, Prepared
from load.doors import Door, doors, label, open_door, side_by_side, split
from load.fairness_fleet import (
    FLEET,
    GIVE_UP_S,
    HEAVY_CLIENTS,
    ITL,
    KEYS,
    LOADS,
    SEQS,
    SIM_FLAGS,
    STORY,
    TARGETS,
    TOKENS,
    VARIANTS,
    answering,
    cpu_shares,
    merge,
    ms,
    outcomes,
    part_b,
    pool,
    rates,
    request,
    summary_b,
)
from load.harness import Bench, Scenario, Table
from load.plots import plot_bar_panels
from load.stats import percentile

# -- part A: one GPU, a light client beside 32 heavy ones -----------------------------------


async def prime(url: str) -> None:
    """Four times the batch at once: the GPU queues them for two streams' time, and its
    reports meanwhile, while Sluice's requests wait there, tell Sluice its room."""
    async with Pool(url, timeout=GIVE_UP_S) as primer:
        item = primer.prepare(request("prime", STORY, TOKENS[0]))
        await drive.open_loop(primer, [(0.0, item)] * (4 * SEQS))


def stories(sender: Pool, key: str, round_: int, tokens: tuple[int, int]) -> Iterator[Prepared]:
    """The key's endless short chats, each asking for its own number of tokens (the same
    draws for every variant of a round)."""
    rng = random.Random(f"{key}-{round_}")
    while True:
        yield sender.prepare(request(key, STORY, rng.randint(*tokens)))


async def part_a(
    door: Door,
    dashboard: str,
    keyed: bool,
    round_: int,
    seconds: dict[str, float],
    tokens: tuple[int, int] = TOKENS,
) -> dict[str, Any]:
    runs: dict[str, drive.Run] = {}
    url = door.url
    async with pool(url, "light", keyed) as light, pool(url, "heavy", keyed) as heavy:
        heavy_item = stories(heavy, "heavy", round_, tokens)
        light_item = stories(light, "light", round_, tokens)
        alone = await drive.closed_loop(light, 1, light_item, seconds=seconds["alone"])

        async def flood() -> None:
            runs["heavy"] = await drive.closed_loop(
                heavy, HEAVY_CLIENTS, heavy_item, seconds=seconds["warm"] + seconds["beside"]
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            await trio.sleep(seconds["warm"])
            cpu0, began = door.cpu(), time.perf_counter()
            light_item = stories(light, "light", round_, tokens)  # the same lengths: paired
            beside = await drive.closed_loop(light, 1, light_item, seconds=seconds["beside"])
            cpu = cpu_shares(cpu0, door.cpu(), time.perf_counter() - began)
    snapshot = (await client.call(dashboard + "/api/snapshot")).json()
    every = alone.records + beside.records + runs["heavy"].records
    return {
        **{phase: _light(run) for phase, run in (("alone", alone), ("beside", beside))},
        "heavy_per_s": runs["heavy"].ok / runs["heavy"].seconds,
        "cpu_share": sum(cpu),
        "cpu_parts": cpu,  # Sluice's, and through the EPP Envoy's
        "answers": outcomes(every),
        "room": [b["room"] for b in snapshot["backends"]],  # what Sluice judged
    }


def _light(run: drive.Run) -> dict[str, Any]:
    ok = [r for r in run.records if r.ok]
    e2e, ttft = ms([r.e2e for r in ok]), ms([r.ttft for r in ok])
    return {"ok": len(ok), "seconds": run.seconds, "ttft_ms": ttft, "e2e_ms": e2e}


def summary_a(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant, over its rounds: the light key alone and beside (pooled), and the rest."""
    out: dict[str, dict[str, Any]] = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        entry: dict[str, Any] = {}
        for phase in ("alone", "beside"):
            parts = [r[phase] for r in mine]
            ttft = [v for p in parts for v in p["ttft_ms"]]
            e2e = [v for p in parts for v in p["e2e_ms"]]
            entry[phase] = {
                "requests": len(ttft),
                "ttft_p50_ms": percentile(ttft, 50),
                "ttft_p99_ms": percentile(ttft, 99),
                "e2e_p50_ms": percentile(e2e, 50),
                "per_s": sum(p["ok"] for p in parts) / sum(p["seconds"] for p in parts),
            }
        # req/s beside over alone on the same lengths: the first requests of each, paired.
        paired = [(r["alone"]["e2e_ms"], r["beside"]["e2e_ms"]) for r in mine]
        paired = [(a[: len(b)], b[: len(a)]) for a, b in paired]  # the same lengths
        entry["beside"]["x_alone"] = sum(sum(a) for a, _ in paired) / sum(sum(b) for _, b in paired)
        entry["heavy_per_s"] = sum(r["heavy_per_s"] for r in mine) / len(mine)
        busiest = max(mine, key=lambda r: r["cpu_share"])
        entry["cpu_share"] = busiest["cpu_share"]
        entry["cpu_parts"] = busiest.get("cpu_parts", [busiest["cpu_share"]])
        entry["answers"] = merge([r["answers"] for r in mine])
        out[variant] = entry
    return out


def stream_ms(rows: list[dict[str, Any]]) -> float:
    """One stream's time on the idle GPU: the median end to end of the light key alone,
    every variant's rounds pooled (the same GPU, idle, whatever the proxy's flags)."""
    return percentile([v for r in rows for v in r["alone"]["e2e_ms"]], 50)


SHORT = (16, 16)  # part S's output tokens: a stream of ~0.3 s
SHORT_P99_MS = 400
# Part S's GPUs: A's but for the prefill, the simulated engine's own (5 ms and 0.02 ms a
# token). With A's 30 ms a request, 16-token streams on 4 sequences put a third of the GPU's
# time in prefills: each stream's decode is slowed ~1.4x by the others' prefills beside it,
# whatever the proxy does (the light key's rate could not reach 0.7x its rate alone even if
# it never waited); the case is about admission.
SHORT_SIM_FLAGS = ("--max-num-seqs", str(SEQS), "--inter-token-latency", str(ITL),
                   "--time-factor-under-load", "1", "--kv-cache-blocks", "1024")  # fmt: skip


# -- the run, its targets, tables and figure ---------------------------------------------


async def measure(bench: Bench) -> dict[str, Any]:
    variants = bench.args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"fairness: unknown variant(s) {', '.join(sorted(unknown))}")
    # Each variant through each door, side by side: sluice, sluice:epp, fcfs, fcfs:epp.
    variants = [label(v, door) for v in variants for door in doors(bench.args.door)]
    rounds = bench.rounds(1, 2)
    seconds_a = {"alone": bench.pick(3.0, 10.0), "warm": 3.0, "beside": bench.pick(5.0, 20.0)}
    phases = (bench.pick(3.0, 10.0), bench.pick(6.0, 20.0))
    # A GPU per variant: a proxy reads what others ran on its engine as others' load, so
    # two proxies taking turns on one GPU would each see the other's flood.
    proxies = await primed(bench, variants, SIM_FLAGS)
    short_proxies = await primed(bench, variants, SHORT_SIM_FLAGS)

    async def one_a(name: str, number: int, short: bool = False) -> dict[str, Any]:
        door = (short_proxies if short else proxies)[name]
        dashboard = bench.stack.dashboard(door.sluice)
        keyed, tokens = VARIANTS[split(name)[0]][1], SHORT if short else TOKENS
        return await part_a(door, dashboard, keyed, number, seconds_a, tokens)

    rows_a = await bench.alternate(rounds, variants, one_a, " A")
    rows_s = await bench.alternate(rounds, variants, partial(one_a, short=True), " S")
    rows_b = await bench.alternate(rounds, variants, partial(part_b, bench, phases=phases), " B")
    result: dict[str, Any] = {"seconds_a": seconds_a, "phases_b": list(phases)}
    result["rates_b"] = rates()
    result |= {"rounds": rounds, "a": rows_a, "s": rows_s, "b": rows_b}
    result["targets"] = targets(
        summary_a(rows_a), stream_ms(rows_a), summary_a(rows_s), summary_b(rows_b)
    )
    return result


async def primed(bench: Bench, names: list[str], sim_flags: tuple[str, ...]) -> dict[str, Door]:
    """A GPU with `sim_flags` and a primed Sluice before it, through its door, for each
    variant (`label(variant, door)`): the doors."""
    sims = await bench.stack.sims(len(names), *sim_flags)
    proxies: dict[str, Door] = {}

    async def ready(name: str, sim: str) -> None:
        variant, door = split(name)
        proxies[name] = await open_door(bench.stack, door, sim, *VARIANTS[variant][0])
        await answering(proxies[name].url)
        await prime(proxies[name].url)

    async with trio.open_nursery() as nursery:
        for name, sim in zip(names, sims, strict=True):
            nursery.start_soon(ready, name, sim)
    return proxies


def targets(
    a: dict[str, dict[str, Any]],
    stream: float,
    short: dict[str, dict[str, Any]],
    b: dict[str, dict[str, Any]],
) -> list[str]:
    """Issue 32's (and 40's) targets, door by door (`A (epp): ...`)."""
    lines: list[str] = []

    def check(label: str, ok: bool) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'} {label}")

    for door in dict.fromkeys(split(name)[1] for part in (a, short, b) for name in part):
        sluice = label("sluice", door)
        for part, summary, bound, bound_text in (
            ("A", a, stream, f"one stream {stream:,.0f} ms"),
            ("S", short, SHORT_P99_MS, f"{SHORT_P99_MS} ms"),
        ):
            if sluice in summary:
                p99, x = (summary[sluice]["beside"][k] for k in ("ttft_p99_ms", "x_alone"))
                where = f"{part} ({door}): light"
                check(f"{where} TTFT p99 {p99:,.0f} ms <= {bound_text}", p99 <= bound)
                check(f"{where} req/s beside heavy {x:.3f}x alone >= 0.7x", x >= 0.7)
        if sluice in b:
            lines += _targets_b(door, b[sluice])
            lines += _saturation_targets(door, b[sluice].get("saturation"))
        lost = sum(v["answers"]["lost"] for part in (a, short, b) for n, v in part.items()
                   if split(n)[1] == door)  # fmt: skip
        check(f"({door}) every request answered 200 or 429 with Retry-After: {lost} lost",
              lost == 0)  # fmt: skip
    return lines


def _targets_b(door: str, entry: dict[str, Any]) -> list[str]:
    """B and C for one door. Without server-timing (Envoy passes none from the picker) when
    a request left the queue is unknown: B reads Sluice's own count, C cannot be told."""
    if entry.get("timed", True):
        share = entry["light_of_fair"]
        held, unheld = (entry["hits"][k] for k in ("held", "unheld"))
        h, u = (t[1] / t[0] if t[0] else float("nan") for t in (held, unheld))
        return [
            f"{_verdict(share >= 0.9)} B ({door}): light {share:.0%} of its fair share >= 90%",
            f"{_verdict(not h < u)} C ({door}): held requests' hit rate {h:.3f} >= unheld "
            f"ones' {u:.3f}",
        ]
    share = entry["snapshot_of_fair"] or float("nan")
    return [
        f"{_verdict(share >= 0.9)} B ({door}): light {share:.0%} of its fair share >= 90% by "
        "Sluice's own count (no server-timing through Envoy)",
        f"n/a C ({door}): no server-timing through Envoy: held or not unknown",
    ]


def _saturation_targets(door: str, signal: dict[str, Any] | None) -> list[str]:
    """Issue 44's: the autoscalers' gauge rises with the offered load and falls after."""
    if not signal or not signal["samples"]:
        return [f"FAIL B ({door}): saturation gauge: no samples"]
    low, high, last = (signal[k] for k in ("mean_low", "mean_high", "last"))
    return [
        f"{_verdict(signal['rises'])} B ({door}): saturation gauge rises with load: mean "
        f"{low:.2f} at {LOADS[0]:g}x -> {high:.2f} at {LOADS[1]:g}x (peak {signal['peak']:.2f})",
        f"{_verdict(signal['falls'])} B ({door}): and falls after: {last:.2f} after the last "
        f"answer < a quarter of {high:.2f}",
    ]


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


HEADERS_A = ["variant", "requests", "TTFT p50", "TTFT p99", "e2e p50", "req/s",
             "alone req/s", "x alone", "heavy req/s", "CPU %", "200/429/lost"]  # fmt: skip
HEADERS_B = ["variant", "offered/s", "dispatched/s", "asked", "dispatched",
             "light of fair", "snapshot", "light TTFT p50", "light TTFT p99",
             "C: hit held / unheld", "429", "CPU %", "200/429/lost"]  # fmt: skip


def _answers(entry: dict[str, Any]) -> str:
    return "{ok}/{refused}/{lost}".format(**entry["answers"])


def _rows_a(a: dict[str, dict[str, Any]]) -> list[list[Any]]:
    return side_by_side([
        (*split(v), [p["requests"], *_ms(p["ttft_p50_ms"], p["ttft_p99_ms"], p["e2e_p50_ms"]),
         p["per_s"], e["alone"]["per_s"], p["x_alone"], e["heavy_per_s"], _cpu(e), _answers(e)])
        for v, e in a.items() for p in [e["beside"]]
    ], 2)  # fmt: skip


def tables(result: dict[str, Any]) -> list[Table]:
    a, b, rounds = summary_a(result["a"]), summary_b(result["b"]), result["rounds"]
    sa, (under, over) = result["seconds_a"], result["phases_b"]
    light, heavy = (result["rates_b"][key][1] for key in KEYS)
    rows_a = _rows_a(a)
    rows_b = side_by_side([
        (*split(v), [e["offered_per_s"], e["capacity_per_s"], _pair(e["asked"]),
         _pair(e["left"]), e["light_of_fair"], e["snapshot_of_fair"], *_ms(e["light_ttft_p50_ms"],
         e["light_ttft_p99_ms"]), " / ".join(_rate(e["hits"][k]) for k in ("held", "unheld")),
         _pair(e["refused"]), _cpu(e), _answers(e)])
        for v, e in b.items()
    ], 2)  # fmt: skip
    alone = [e["alone"]["ttft_p99_ms"] for e in a.values()]
    return [
        Table(
            f"A: one simulated GPU of {SEQS} sequences, streams of {TOKENS[0]}-{TOKENS[1]} tokens "
            f"at {ITL * 1e3:g} ms a token; the light key's 1 closed-loop client beside the heavy "
            f"key's {HEAVY_CLIENTS} ({sa['beside']:g} s, {sa['warm']:g} s after them), and alone "
            f"({sa['alone']:g} s: TTFT p99 {max(alone):.0f} ms; one stream on the idle GPU, "
            f"median: {stream_ms(result['a']):,.0f} ms), {rounds} round(s) pooled; ms; x alone: "
            "req/s over alone's on the same lengths; "
            + _doors_note(result["a"])
            + harness.targets_met(result["targets"], TARGETS),
            HEADERS_A,
            rows_a,
            digits=2,
        ),
        *_short_table(result),
        Table(
            f"B: {FLEET} simulated GPUs, rag, light {light:.2f}/s and heavy {heavy:.1f}/s open "
            f"loop ({over:g} s at {LOADS[1]:g}x the fleet's {(light + heavy) / LOADS[1]:.1f}/s by "
            f"estimate, after {under:g} s at {LOADS[0]:g}x), {rounds} round(s) summed; asked, "
            "dispatched, 429: light/heavy, in the 2x phase after its first quarter; light of "
            "fair: what it got over its max-min fair share (snapshot: the proxy's own count); "
            "C: the GPU's prefix-hit rate (requests) of the requests held (server-timing queue "
            f"> 0) or not, sent after half the {LOADS[0]:g}x phase (warm caches; the unheld "
            "mostly from that phase)" + _untimed(b),
            HEADERS_B,
            rows_b,
            digits=2,
        ),
        Table("issue 32's targets", ["check"], [[line] for line in result["targets"]]),
    ]


def _short_table(result: dict[str, Any]) -> list[Table]:
    if not result.get("s"):
        return []
    short = summary_a(result["s"])
    alone = [e["alone"]["ttft_p99_ms"] for e in short.values()]
    title = (
        f"S: GPUs of {SEQS} sequences (the sim's own prefill), streams of {SHORT[0]} tokens at "
        f"{ITL * 1e3:g} ms a token "
        f"(shorter than a scrape's 0.5 s); alone TTFT p99 {max(alone):.0f} ms; one stream on "
        f"the idle GPU, median: {stream_ms(result['s']):,.0f} ms; targets: light TTFT p99 <= "
        f"{SHORT_P99_MS} ms, req/s >= 0.7x alone (issue 40)"
    )
    return [Table(title, HEADERS_A, _rows_a(short), digits=2)]


def _ms(*values: float) -> list[str]:
    return [f"{value:,.0f}" for value in values]


def _cpu(entry: dict[str, Any]) -> str:
    return " + ".join(f"{part * 100:.1f}" for part in entry.get("cpu_parts", [entry["cpu_share"]]))


def _doors_note(rows: list[dict[str, Any]]) -> str:
    """What `a | b` in a cell means, when the run went through both doors."""
    through = {split(r["variant"])[1] for r in rows}
    if through == {"epp"}:
        return "through Envoy with Sluice as its endpoint picker (CPU %: Sluice + Envoy); "
    if len(through) < 2:
        return ""
    return ("a | b: through Sluice's proxy | through Envoy with Sluice as its endpoint picker "
            "(CPU %: Sluice + Envoy); ")  # fmt: skip


def _untimed(b: dict[str, dict[str, Any]]) -> str:
    if all(entry.get("timed", True) for entry in b.values()):
        return ""
    return ("; through the EPP no server-timing comes back through Envoy, so when a request "
            "left the queue is unknown (dispatched, light of fair, C: n/a)")  # fmt: skip


def _rate(tally: list[int]) -> str:
    """A GPU hit rate and its number of requests."""
    return f"{tally[1] / tally[0]:.3f} ({tally[0]})" if tally[0] else "n/a"


def _pair(counts: dict[str, int] | None) -> str:
    return "n/a" if counts is None else f"{counts['light']}/{counts['heavy']}"


def plot(result: dict[str, Any], png: Path) -> None:
    a, b = summary_a(result["a"]), summary_b(result["b"])
    p99 = {v: [e["alone"]["ttft_p99_ms"], e["beside"]["ttft_p99_ms"]] for v, e in a.items()}
    hits = {v: [t[1] / t[0] if t[0] else 0.0 for t in e["hits"].values()] for v, e in b.items()}
    panels = {
        "A: light key TTFT p99 (ms)": (["alone", "beside heavy"], p99),
        "B: light key, dispatched / fair share": (
            ["2x"],
            {v: [e["light_of_fair"]] for v, e in b.items()},
        ),
        "C: prefix-hit rate": (["held", "unheld"], hits),
    }
    plot_bar_panels(panels, png)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--variants", default="sluice,fcfs", help=f"comma-separated of {','.join(VARIANTS)}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--door",
        choices=("proxy", "epp", "both"),
        default="both",
        help="through Sluice's proxy, Envoy with Sluice as its endpoint picker, or both",
    )


SCENARIO = Scenario(
    name="fairness",
    reproduces="issue 32",
    about="a heavy key at 10x a light key's rate on saturated GPUs: fair queuing vs FCFS",
    reference=(
        "issue 32 targets: A: the light key's TTFT p99 beside a 32-client heavy key <= one\n"
        "stream's time on the idle GPU, its req/s >= 0.7x alone (FCFS: ~2 s p99 expected);\n"
        "S (issue 40: p99 637 ms and 0.48x before): TTFT p99 <= 400 ms, req/s >= 0.7x alone;\n"
        "B: at 2x a 4-GPU fleet, the light key >= 90% of its fair share; C: held requests hit\n"
        "the prefix cache no less than unheld ones; every request answered 200 or 429.\n"
        "issue 44: B's saturation gauge rises with the offered load and falls after."
    ),
    measure=measure,
    tables=tables,
    plot=plot,
    options=options,
)
