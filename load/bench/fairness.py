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
key's 32 (started 3 s before); each proxy primed once (8 requests at once: the GPU queues,
Sluice learns its room), so rounds measure the steady state. B: 4 fresh GPUs a round (KV
caches of 1,024 blocks, room for a few of rag's 8 system prompts of 2-4k tokens); both keys
open loop on `rag`, the heavy key at 10x the light key's rate, at 0.5x the fleet's capacity
(16 sequences over a rag request's measured 1.8 s), then 2x. A request is dispatched at its
send time plus its `server-timing` queue time; a key's fair share of the dispatches is
max-min by weight over what each key asked (`fair_shares`, the proxy's own). C: B's
requests, held (queue time > 0) or not, and a prefix hit (the GPU's `cached_tokens` > 0) or
not. Every request must be answered 200, or 429 with Retry-After: anything else is lost.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from app.observe.admission_stats import fair_shares
from app.proxy.accounting import fingerprint
from load import arrivals, client, drive, harness
from load.client import CHAT, Pool, Prepared
from load.drive import Record
from load.harness import Bench, Scenario, Table
from load.plots import plot_bar_panels
from load.processes import Stack, tree_cpu
from load.stats import percentile
from load.workloads import Corpus, Request, Workload

SEQS = 4
TOKENS = (50, 100)  # output tokens, drawn per request: streams of 1-2 s
ITL = 0.02
PREFILL_OVERHEAD = 0.03
SIM_FLAGS = ("--max-num-seqs", str(SEQS), "--max-num-batched-tokens", "2048",
             "--prefill-overhead", str(PREFILL_OVERHEAD), "--prefill-per-token", "0.00015",
             "--inter-token-latency", str(ITL), "--time-factor-under-load", "1",
             "--kv-cache-blocks", "1024")  # fmt: skip
CAP = ("--max-inflight-per-backend", str(SEQS))
VARIANTS: dict[str, tuple[tuple[str, ...], bool]] = {  # proxy flags, whether keys are sent
    "sluice": ((), True),
    "fcfs": (("--policy", "round_robin", *CAP), False),
    "capped": (CAP, True),
}
KEYS = {"light": "sk-light", "heavy": "sk-heavy"}
HEAVY_CLIENTS = 32
FLEET = 4
HEAVY_X = 10  # the heavy key's rate over the light key's
LOADS = (0.5, 2.0)  # B's offered load over NOMINAL, phase by phase
# A rag request's time on a full GPU: 75 tokens at 20 ms, prefills and the stalls of other
# requests' chunked prefills (1.8 s: 16 sequences served 8.8-9.1 requests/s, 2026-11-26).
NOMINAL = FLEET * SEQS / 1.8  # requests/s the fleet serves
GIVE_UP_S = 120.0
TARGETS = "issue 32's"
STORY = [{"role": "user", "content": "Tell me a story about a river."}]


def request(key: str, messages: list[dict[str, str]], tokens: int) -> Request:
    body = {"model": "sim", "messages": messages, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    return Request(CHAT, body, key)


def pool(url: str, key: str, keyed: bool) -> Pool:
    headers = {"authorization": f"Bearer {KEYS[key]}"} if keyed else {}
    return Pool(url, headers, timeout=GIVE_UP_S)


def outcomes(records: Sequence[Record]) -> dict[str, int]:
    """Sent, answered 200, refused 429 with Retry-After, and lost (anything else)."""
    ok = sum(r.status == 200 and r.ok for r in records)
    refused = sum(r.status == 429 and r.retry_after is not None for r in records)
    return {"sent": len(records), "ok": ok, "refused": refused, "lost": len(records) - ok - refused}


def ms(values: Sequence[float | None]) -> list[float]:
    return [round(v * 1e3, 1) for v in values if v is not None]


def merge(counts: Sequence[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for count in counts:
        total.update(count)  # keeps zeros, as `+` would not
    return dict(total)


async def answering(url: str) -> None:
    if not await harness.answers(url, {}, {"model": "sim", "messages": STORY, "max_tokens": 1}):
        raise RuntimeError(f"the proxy at {url} never answered")  # harness.answers waits 60 s


# -- part A: one GPU, a light client beside 32 heavy ones -----------------------------------


async def prime(url: str) -> None:
    """Twice the batch at once: the GPU queues, its next report tells Sluice its room."""
    async with Pool(url, timeout=GIVE_UP_S) as primer:
        item = primer.prepare(request("prime", STORY, TOKENS[0]))
        await drive.open_loop(primer, [(0.0, item)] * (2 * SEQS))


def stories(sender: Pool, key: str, round_: int) -> Iterator[Prepared]:
    """The key's endless short chats, each asking for its own number of tokens (the same
    draws for every variant of a round)."""
    rng = random.Random(f"{key}-{round_}")
    while True:
        yield sender.prepare(request(key, STORY, rng.randint(*TOKENS)))


async def part_a(
    url: str, pid: int, dashboard: str, keyed: bool, round_: int, seconds: dict[str, float]
) -> dict[str, Any]:
    runs: dict[str, drive.Run] = {}
    async with pool(url, "light", keyed) as light, pool(url, "heavy", keyed) as heavy:
        heavy_item, light_item = stories(heavy, "heavy", round_), stories(light, "light", round_)
        alone = await drive.closed_loop(light, 1, light_item, seconds=seconds["alone"])

        async def flood() -> None:
            runs["heavy"] = await drive.closed_loop(
                heavy, HEAVY_CLIENTS, heavy_item, seconds=seconds["warm"] + seconds["beside"]
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            await trio.sleep(seconds["warm"])
            cpu0, began = tree_cpu(pid), time.perf_counter()
            light_item = stories(light, "light", round_)  # the same lengths again: paired
            beside = await drive.closed_loop(light, 1, light_item, seconds=seconds["beside"])
            cpu, elapsed = tree_cpu(pid) - cpu0, time.perf_counter() - began
    snapshot = (await client.call(dashboard + "/api/snapshot")).json()
    every = alone.records + beside.records + runs["heavy"].records
    return {
        **{phase: _light(run) for phase, run in (("alone", alone), ("beside", beside))},
        "heavy_per_s": runs["heavy"].ok / runs["heavy"].seconds,
        "cpu_share": cpu / elapsed,
        "answers": outcomes(every),
        "room": [b.get("capacity") for b in snapshot["backends"]],  # what Sluice learnt
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
        entry["cpu_share"] = max(r["cpu_share"] for r in mine)
        entry["answers"] = merge([r["answers"] for r in mine])
        out[variant] = entry
    return out


def stream_ms(rows: list[dict[str, Any]]) -> float:
    """One stream's time on the idle GPU: the median end to end of the light key alone,
    every variant's rounds pooled (the same GPU, idle, whatever the proxy's flags)."""
    return percentile([v for r in rows for v in r["alone"]["e2e_ms"]], 50)


# -- parts B and C: a fleet of 4 GPUs at 2x, the heavy key at 10x the light key's rate -----


def rates() -> dict[str, tuple[float, ...]]:
    """Each key's rate in each phase: the heavy key HEAVY_X times the light key's."""
    light = tuple(NOMINAL * load / (1 + HEAVY_X) for load in LOADS)
    return {"light": light, "heavy": tuple(HEAVY_X * rate for rate in light)}


def plan(key: str, phases: Sequence[float], seed: int) -> list[tuple[float, Request]]:
    """The key's rag requests at Poisson times, phase after phase. The system prompts are
    the same for both keys (one seed); the questions are each key's own."""
    workload = Workload("rag", Corpus.default(), random.Random(seed))
    rng = workload.rng = random.Random(f"{seed}-{key}")
    times, offset = [], 0.0
    for index, (rate, length) in enumerate(zip(rates()[key], phases, strict=True)):
        draw = seed * 100 + list(KEYS).index(key) * 10 + index
        times += [offset + at for at in arrivals.schedule("poisson", rate, length, draw)]
        offset += length
    return [
        (at, request(key, workload.next()[0].body["messages"], rng.randint(*TOKENS)))
        for at in times
    ]


async def part_b(
    bench: Bench, variant: str, round_: int, phases: Sequence[float]
) -> dict[str, Any]:
    flags, keyed = VARIANTS[variant]
    seed = bench.args.seed * 1000 + round_
    plans = {key: plan(key, phases, seed) for key in KEYS}
    async with Stack(bench.args.proxy_arg) as stack:
        url = await stack.proxy(await stack.sims(FLEET, *SIM_FLAGS), *flags)
        await answering(url)
        pid, dashboard = stack.pids[url], stack.dashboard(url)
        runs: dict[str, drive.Run] = {}
        start = time.perf_counter()

        async def send(key: str) -> None:
            async with pool(url, key, keyed) as sender:
                items = [(at, sender.prepare(r)) for at, r in plans[key]]
                runs[key] = await drive.open_loop(sender, items, start=start)

        async with trio.open_nursery() as nursery:
            for key in KEYS:
                nursery.start_soon(send, key)
            await trio.sleep(phases[0])
            cpu0 = tree_cpu(pid)
            await trio.sleep(phases[1])
            cpu = tree_cpu(pid) - cpu0
            snapshot = (await client.call(dashboard + "/api/snapshot")).json()
    shares = snapshot["admission"]["models"].get("sim", {}).get("keys", {})
    by_label = {fingerprint(token.encode()): key for key, token in KEYS.items()}
    return {
        # The 2x phase but its first quarter: a queue in its steady state at both ends (sent
        # before, dispatched in it ~ sent in it, dispatched after).
        **dispatches(runs, phases[0] + phases[1] / 4, phases[0] + phases[1]),
        **prefix_hits([r for run in runs.values() for r in run.records], phases[0] / 2),
        "snapshot": {by_label[k]: v for k, v in shares.items() if k in by_label},
        "cpu_share": cpu / phases[1],
        "answers": outcomes([r for run in runs.values() for r in run.records]),
        "answers_by_key": {key: outcomes(run.records) for key, run in runs.items()},
    }


def dispatches(runs: dict[str, drive.Run], since: float, until: float) -> dict[str, Any]:
    """What each key asked for and got between `since` and `until` (s after the start), and
    the light key's time to first token over the requests it sent then."""

    def dispatched(r: Record) -> bool:
        return r.ok and since <= r.start + r.timing.get("queue", 0.0) < until

    light = [r for r in runs["light"].records if r.ok and since <= r.start < until]
    return {
        "asked": {k: sum(since <= r.start < until for r in run.records) for k, run in runs.items()},
        "left": {k: sum(map(dispatched, run.records)) for k, run in runs.items()},
        "seconds": until - since,
        "light_ttft_ms": ms([r.ttft for r in light]),
        "light_queue_ms": ms([r.timing.get("queue", 0.0) for r in light]),
    }


def prefix_hits(records: Sequence[Record], warm: float) -> dict[str, Any]:
    """Held or not, a prefix hit or not (the GPU's cached tokens; Sluice's route says
    `prefix-hit` when it predicted one), over the answered requests sent after `warm` s."""
    counts = {"held": [0, 0, 0], "unheld": [0, 0, 0]}  # requests, GPU hits, routed as hits
    for r in records:
        if r.ok and r.start >= warm and r.cached_tokens is not None:
            tally = counts["held" if r.timing.get("queue", 0.0) > 0 else "unheld"]
            tally[0] += 1
            tally[1] += r.cached_tokens > 0
            tally[2] += (r.route or "").endswith("prefix-hit")
    return {"hits": counts}


def summary_b(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        asked = merge([r["asked"] for r in mine])
        left = merge([r["left"] for r in mine])
        seconds = sum(r["seconds"] for r in mine)
        fair = fair_shares(asked, {}, sum(left.values()))
        ttft = [v for r in mine for v in r["light_ttft_ms"]]
        snap = [r["snapshot"]["light"] for r in mine if "light" in r["snapshot"]]
        snap_left, snap_fair = (sum(s[k] for s in snap) for k in ("left", "fair_left"))
        hits = {k: [sum(r["hits"][k][i] for r in mine) for i in range(3)] for k in mine[0]["hits"]}
        out[variant] = {
            "asked": asked,
            "left": left,
            "offered_per_s": sum(asked.values()) / seconds,
            "capacity_per_s": sum(left.values()) / seconds,
            "light_fair": fair["light"],
            "light_of_fair": left["light"] / fair["light"] if fair["light"] else float("nan"),
            "snapshot_of_fair": snap_left / snap_fair if snap_fair else None,
            "light_ttft_p50_ms": percentile(ttft, 50),
            "light_ttft_p99_ms": percentile(ttft, 99),
            "cpu_share": max(r["cpu_share"] for r in mine),
            "answers": merge([r["answers"] for r in mine]),
            "refused": {k: sum(r["answers_by_key"][k]["refused"] for r in mine) for k in KEYS},
            "hits": hits,
        }  # fmt: skip
    return out


# -- the run, its targets, tables and figure ---------------------------------------------


async def measure(bench: Bench) -> dict[str, Any]:
    variants = bench.args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"fairness: unknown variant(s) {', '.join(sorted(unknown))}")
    rounds = bench.rounds(1, 2)
    seconds_a = {"alone": bench.pick(3.0, 10.0), "warm": 3.0, "beside": bench.pick(5.0, 20.0)}
    phases = (bench.pick(3.0, 10.0), bench.pick(6.0, 20.0))
    # A GPU per variant: a proxy reads what others ran on its engine as others' load, so
    # two proxies taking turns on one GPU would each see the other's flood.
    sims = await bench.stack.sims(len(variants), *SIM_FLAGS)
    proxies: dict[str, str] = {}

    async def ready(variant: str, sim: str) -> None:
        proxies[variant] = await bench.stack.proxy(sim, *VARIANTS[variant][0])
        await answering(proxies[variant])
        await prime(proxies[variant])

    async with trio.open_nursery() as nursery:
        for variant, sim in zip(variants, sims, strict=True):
            nursery.start_soon(ready, variant, sim)

    async def one_a(variant: str, number: int) -> dict[str, Any]:
        url = proxies[variant]
        pid, dashboard = bench.stack.pids[url], bench.stack.dashboard(url)
        return await part_a(url, pid, dashboard, VARIANTS[variant][1], number, seconds_a)

    rows_a = await bench.alternate(rounds, variants, one_a, " A")
    rows_b = await bench.alternate(rounds, variants, partial(part_b, bench, phases=phases), " B")
    result: dict[str, Any] = {"seconds_a": seconds_a, "phases_b": list(phases)}
    result["rates_b"] = rates()
    result |= {"rounds": rounds, "a": rows_a, "b": rows_b}
    result["targets"] = targets(summary_a(rows_a), stream_ms(rows_a), summary_b(rows_b))
    return result


def targets(a: dict[str, dict[str, Any]], stream: float, b: dict[str, dict[str, Any]]) -> list[str]:
    lines: list[str] = []

    def check(label: str, ok: bool) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'} {label}")

    if "sluice" in a:
        s = a["sluice"]
        p99 = s["beside"]["ttft_p99_ms"]
        check(f"A: light TTFT p99 {p99:,.0f} ms <= one stream {stream:,.0f} ms", p99 <= stream)
        x = s["beside"]["x_alone"]
        check(f"A: light req/s beside heavy {x:.3f}x alone >= 0.7x", x >= 0.7)
    if "sluice" in b:
        share = b["sluice"]["light_of_fair"]
        check(f"B: light {share:.0%} of its fair share >= 90%", share >= 0.9)
        held, unheld = (b["sluice"]["hits"][k] for k in ("held", "unheld"))
        h, u = (t[1] / t[0] if t[0] else float("nan") for t in (held, unheld))
        check(f"C: held requests' hit rate {h:.3f} >= unheld ones' {u:.3f}", not h < u)
    lost = sum(v["answers"]["lost"] for part in (a, b) for v in part.values())
    check(f"every request answered 200 or 429 with Retry-After: {lost} lost", lost == 0)
    return lines


HEADERS_A = ["variant", "requests", "TTFT p50", "TTFT p99", "e2e p50", "req/s", "alone req/s",
             "x alone", "heavy req/s", "proxy CPU %", "200/429/lost"]  # fmt: skip
HEADERS_B = ["variant", "offered/s", "dispatched/s", "asked", "dispatched", "light of fair",
             "snapshot", "light TTFT p50", "light TTFT p99", "C: hit held / unheld", "429",
             "proxy CPU %", "200/429/lost"]  # fmt: skip


def _answers(entry: dict[str, Any]) -> str:
    return "{ok}/{refused}/{lost}".format(**entry["answers"])


def tables(result: dict[str, Any]) -> list[Table]:
    a, b, rounds = summary_a(result["a"]), summary_b(result["b"]), result["rounds"]
    sa, (under, over) = result["seconds_a"], result["phases_b"]
    light, heavy = (result["rates_b"][key][1] for key in KEYS)
    rows_a = [
        [v, p["requests"], *_ms(p["ttft_p50_ms"], p["ttft_p99_ms"], p["e2e_p50_ms"]), p["per_s"],
         e["alone"]["per_s"], p["x_alone"], e["heavy_per_s"], _cpu(e), _answers(e)]
        for v, e in a.items() for p in [e["beside"]]
    ]  # fmt: skip
    rows_b = [
        [v, e["offered_per_s"], e["capacity_per_s"], _pair(e["asked"]), _pair(e["left"]),
         e["light_of_fair"], e["snapshot_of_fair"], *_ms(e["light_ttft_p50_ms"],
         e["light_ttft_p99_ms"]), " / ".join(_rate(e["hits"][k]) for k in ("held", "unheld")),
         _pair(e["refused"]), _cpu(e), _answers(e)]
        for v, e in b.items()
    ]  # fmt: skip
    alone = [e["alone"]["ttft_p99_ms"] for e in a.values()]
    return [
        Table(
            f"A: one simulated GPU of {SEQS} sequences, streams of {TOKENS[0]}-{TOKENS[1]} tokens "
            f"at {ITL * 1e3:g} ms a token; the light key's 1 closed-loop client beside the heavy "
            f"key's {HEAVY_CLIENTS} ({sa['beside']:g} s, {sa['warm']:g} s after them), and alone "
            f"({sa['alone']:g} s: TTFT p99 {max(alone):.0f} ms; one stream on the idle GPU, "
            f"median: {stream_ms(result['a']):,.0f} ms), {rounds} round(s) pooled; ms; x alone: "
            "req/s over alone's on the same lengths; "
            + harness.targets_met(result["targets"], TARGETS),
            HEADERS_A,
            rows_a,
            digits=2,
        ),
        Table(
            f"B: {FLEET} simulated GPUs, rag, light {light:.2f}/s and heavy {heavy:.1f}/s open "
            f"loop ({over:g} s at {LOADS[1]:g}x the fleet's {(light + heavy) / LOADS[1]:.1f}/s by "
            f"estimate, after {under:g} s at {LOADS[0]:g}x), {rounds} round(s) summed; asked, "
            "dispatched, 429: light/heavy, in the 2x phase after its first quarter; light of "
            "fair: what it got over its max-min fair share (snapshot: the proxy's own count); "
            "C: the GPU's prefix-hit rate (requests) of the requests held (server-timing queue "
            f"> 0) or not, sent after half the {LOADS[0]:g}x phase (warm caches; the unheld "
            "mostly from that phase)",
            HEADERS_B,
            rows_b,
            digits=2,
        ),
        Table("issue 32's targets", ["check"], [[line] for line in result["targets"]]),
    ]


def _ms(*values: float) -> list[str]:
    return [f"{value:,.0f}" for value in values]


def _cpu(entry: dict[str, Any]) -> str:
    return f"{entry['cpu_share'] * 100:.1f}"


def _rate(tally: list[int]) -> str:
    """A GPU hit rate and its number of requests."""
    return f"{tally[1] / tally[0]:.3f} ({tally[0]})" if tally[0] else "n/a"


def _pair(counts: dict[str, int]) -> str:
    return f"{counts['light']}/{counts['heavy']}"


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


SCENARIO = Scenario(
    name="fairness",
    reproduces="issue 32",
    about="a heavy key at 10x a light key's rate on saturated GPUs: fair queuing vs FCFS",
    reference=(
        "issue 32 targets: A: the light key's TTFT p99 beside a 32-client heavy key <= one\n"
        "stream's time on the idle GPU, its req/s >= 0.7x alone (FCFS: ~2 s p99 expected);\n"
        "B: at 2x a 4-GPU fleet, the light key >= 90% of its fair share; C: held requests hit\n"
        "the prefix cache no less than unheld ones; every request answered 200 or 429."
    ),
    measure=measure,
    tables=tables,
    plot=plot,
    options=options,
)
