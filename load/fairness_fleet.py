"""The fleet half of `python -m load bench fairness` (issue 32's parts B and C), and what its
parts share: the two keys, their requests, the simulated GPUs and the variants.

B: 4 fresh GPUs a round (KV caches of 1,024 blocks, room for a few of rag's 8 system prompts
of 2-4k tokens); both keys open loop on `rag`, the heavy key at 10x the light key's rate, at
0.5x the fleet's capacity (16 sequences over a rag request's measured 1.8 s), then 2x. A
request is dispatched at its send time plus its `server-timing` queue time; a key's fair
share of the dispatches is max-min by weight over what each key asked (`fair_shares`, the
proxy's own). C: B's requests, held (queue time > 0) or not, and a prefix hit (the GPU's
`cached_tokens` > 0) or not. Every request must be answered 200, or 429 with Retry-After:
anything else is lost. A variant's name may end in its door (`sluice:epp`, load/doors.py);
through Envoy no server-timing comes back, so there B reads Sluice's own count alone.

B also samples the proxy's `sluice_admission_saturation{model="sim"}` (the autoscalers'
gauge, issue 44) every SAMPLE_S from the first request until TAIL_S after the last answer:
its series is in the JSON, and it must rise with the offered load and fall after
(`saturation_verdict`).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import trio

from app.observe.admission_stats import fair_shares
from app.preprocess.accounting import fingerprint
from load import arrivals, client, drive, harness
from load.client import CHAT, Pool
from load.doors import open_door, split
from load.drive import Record
from load.harness import Bench
from load.processes import Stack
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
SAMPLE_S = 0.5  # between two reads of the saturation gauge
TAIL_S = 1.5  # read on after the last answer: an engine's next report shows it idle
SATURATION_SERIES = 'sluice_admission_saturation{model="sim"} '
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


def cpu_shares(before: Sequence[float], after: Sequence[float], seconds: float) -> list[float]:
    """Each process's CPU over `seconds` of wall time (`Door.cpu` read before and after)."""
    return [round((a - b) / seconds, 4) for b, a in zip(before, after, strict=True)]


async def answering(url: str) -> None:
    if not await harness.answers(url, {}, {"model": "sim", "messages": STORY, "max_tokens": 1}):
        raise RuntimeError(f"the proxy at {url} never answered")  # harness.answers waits 60 s


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


async def part_b(bench: Bench, name: str, round_: int, phases: Sequence[float]) -> dict[str, Any]:
    variant, door_name = split(name)
    flags, keyed = VARIANTS[variant]
    seed = bench.args.seed * 1000 + round_
    plans = {key: plan(key, phases, seed) for key in KEYS}
    async with Stack(bench.args.proxy_arg) as stack:
        door = await open_door(stack, door_name, await stack.sims(FLEET, *SIM_FLAGS), *flags)
        url = door.url
        await answering(url)
        dashboard = stack.dashboard(door.sluice)
        runs: dict[str, drive.Run] = {}
        series: list[tuple[float, float]] = []
        start = time.perf_counter()

        async def send(key: str) -> None:
            async with pool(url, key, keyed) as sender:
                items = [(at, sender.prepare(r)) for at, r in plans[key]]
                runs[key] = await drive.open_loop(sender, items, start=start)

        async with trio.open_nursery() as sampling:
            sampling.start_soon(sample_saturation, door.sluice + "/metrics", start, series)
            async with trio.open_nursery() as nursery:
                for key in KEYS:
                    nursery.start_soon(send, key)
                await trio.sleep(phases[0])
                cpu0 = door.cpu()
                await trio.sleep(phases[1])
                cpu = cpu_shares(cpu0, door.cpu(), phases[1])
                snapshot = (await client.call(dashboard + "/api/snapshot")).json()
            answered = time.perf_counter() - start
            await trio.sleep(TAIL_S)
            sampling.cancel_scope.cancel()
    shares = snapshot["admission"]["models"].get("sim", {}).get("keys", {})
    by_label = {fingerprint(token.encode()): key for key, token in KEYS.items()}
    every = [r for run in runs.values() for r in run.records]
    return {
        # The 2x phase but its first quarter: a queue in its steady state at both ends (sent
        # before, dispatched in it ~ sent in it, dispatched after).
        **dispatches(runs, phases[0] + phases[1] / 4, phases[0] + phases[1]),
        **prefix_hits(every, phases[0] / 2),
        "snapshot": {by_label[k]: v for k, v in shares.items() if k in by_label},
        "cpu_share": sum(cpu),
        "cpu_parts": cpu,  # Sluice's, and through the EPP Envoy's
        # When a request left the queue is known from its server-timing header (the proxy's).
        "timed": any(r.server_timing for r in every if r.ok),
        "answers": outcomes(every),
        "answers_by_key": {key: outcomes(run.records) for key, run in runs.items()},
        # [s after the start, gauge]; the phases' ends and the last answer, to read it by.
        "saturation": {"series": series, "phases": list(phases), "answered": answered},
    }


async def sample_saturation(url: str, start: float, series: list[tuple[float, float]]) -> None:
    """Read the proxy's saturation gauge every SAMPLE_S into `series` until cancelled."""
    while True:
        text = (await client.call(url)).text
        at = text.find("\n" + SATURATION_SERIES)
        if at >= 0:
            line = text[at + 1 + len(SATURATION_SERIES) :].partition("\n")[0]
            series.append((round(time.perf_counter() - start, 2), float(line)))
        await trio.sleep(SAMPLE_S)


def saturation_verdict(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over a variant's rounds: the gauge's mean in each phase (the first quarter of the
    second left out: the queue builds), its peak, and its last reading after the last
    answer; it rises when the 2x phase's mean is over the 0.5x phase's, and falls when the
    last reading is under a quarter of the 2x phase's mean."""
    low: list[float] = []
    high: list[float] = []
    last: list[float] = []
    for row in rows:
        signal = row.get("saturation")
        if not signal or not signal["series"]:
            continue
        first, second = signal["phases"]
        low += [v for t, v in signal["series"] if t < first]
        high += [v for t, v in signal["series"] if first + second / 4 <= t < first + second]
        last.append(signal["series"][-1][1])
    if not (low and high and last):
        return {"samples": 0}
    low_mean, high_mean = sum(low) / len(low), sum(high) / len(high)
    return {
        "samples": sum(len(row["saturation"]["series"]) for row in rows if "saturation" in row),
        "mean_low": low_mean,
        "mean_high": high_mean,
        "peak": max(high),
        "last": max(last),
        "rises": high_mean > low_mean,
        "falls": max(last) < high_mean / 4,
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
        timed = all(r.get("timed", True) for r in mine)
        busiest = max(mine, key=lambda r: r["cpu_share"])
        nan = float("nan")
        out[variant] = {
            "asked": asked,
            "left": left if timed else None,
            "timed": timed,
            "offered_per_s": sum(asked.values()) / seconds,
            "capacity_per_s": sum(left.values()) / seconds if timed else nan,
            "light_fair": fair["light"],
            "light_of_fair": left["light"] / fair["light"] if fair["light"] and timed else nan,
            "snapshot_of_fair": snap_left / snap_fair if snap_fair else None,
            "light_ttft_p50_ms": percentile(ttft, 50),
            "light_ttft_p99_ms": percentile(ttft, 99),
            "cpu_share": busiest["cpu_share"],
            "cpu_parts": busiest.get("cpu_parts", [busiest["cpu_share"]]),
            "answers": merge([r["answers"] for r in mine]),
            "refused": {k: sum(r["answers_by_key"][k]["refused"] for r in mine) for k in KEYS},
            "hits": hits if timed else {k: [0, 0, 0] for k in hits},
            "saturation": saturation_verdict(mine),
        }  # fmt: skip
    return out
