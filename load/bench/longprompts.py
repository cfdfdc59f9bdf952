"""`python -m load bench longprompts`: long unique prompts on a GPU's timing (issue 34).

One simulated GPU that prefills as a GPU does (`--prefill-per-token 0.00004` s a prompt
word: the sim counts words, ~0.57 a DeepSeek token, so ~44k tokens/s; plus
`--prefill-overhead 0.02` s a request; 16-token answers), its window (200,000) and KV cache
wide enough for 8 prompts of 128k tokens at once, and in front of it, taking turns by round,
`direct` (the GPU itself) and `sluice` (`sluice serve`, default flags but the same window;
under `python -m load compare REV --bench longprompts` also REV's, `sluice@REV`).
Each round and shape, 8 closed-loop clients send a fixed number of unique chats each: one
user message of ~8k, ~32k, ~40k or ~128k tokens, or a conversation of 3,000 short messages;
each starts with a random nonce (then prose from load/corpus.txt), so no prefix is shared and
no cache helps. Meanwhile a probe process sends `GET /health` every 10 ms.

Reported per shape: requests/s (answers over the time from the first send to the last
answer: the GPU works while any prefill is left, so this is its throughput) and Sluice's
over direct's in the same round; Sluice's CPU per request above idle (/proc: the process
and its render workers) and that of the event loop's thread alone; /health p50, p99 and max
while loaded; and the stall detector's blocking time per request by stage
(`sluice_event_loop_stall_stage_seconds`: the innermost frame of Sluice's code on the
stall's stack; stalls the GIL or the OS caused, by cause alone). The detector sees only
steps over its threshold (10 ms by default; `--proxy-arg=--stall-threshold-ms=2` looks
closer).

The shapes run in this order on one Sluice, as a long-lived proxy's would: its prefix index
(262,144 blocks) fills during the 128k shape, and from then on each request's blocks evict
as many old ones, a cost the 8k and 32k shapes do not pay yet.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from load import drive, harness
from load.client import CHAT, Pool, Prepared, encode
from load.harness import Bench, Scenario, Table
from load.plots import plot_bars
from load.processes import MODEL, tree_cpu
from load.stats import Ranged, by_group, paired_change, with_range
from load.workloads import Corpus, nonce

CLIENTS = 8
PROBE_INTERVAL_S = 0.01
WINDOW = ("--max-model-len", "200000")
SIM_FLAGS = (
    *WINDOW,
    "--prefill-per-token", "0.00004",
    "--prefill-overhead", "0.02",
    # Room for 8 prompts of 128k tokens: a full cache would make Sluice's admission hold
    # requests back (--max-kv-usage), which is not what this measures.
    "--kv-cache-blocks", "131072",
)  # fmt: skip
ANSWER_TOKENS = 16
CHAT_MESSAGES = 3000
IDLE_S = 3.0  # how long the idle CPU (the probe's /health polls, timers) is measured
COLUMNS = ("requests_per_s", "cpu_ms_per_request", "loop_ms_per_request",
           "health_p50_ms", "health_p99_ms")  # fmt: skip
STAGE_SUM = "sluice_event_loop_stall_stage_seconds_sum"
BLOCKING = "blocking"
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int  # of its one user message; 0: a conversation of CHAT_MESSAGES messages
    per_client: int  # requests each client sends in a round
    quick_per_client: int  # the same with --quick; 0: left out


SHAPES = (
    Shape("8k", 8_000, 6, 2),
    Shape("32k", 32_000, 3, 1),
    Shape("40k", 40_000, 3, 0),  # issue 34's first target: /health p99 <= 10 ms, >= 0.95x
    Shape("128k", 128_000, 2, 0),
    Shape("3,000 msgs", 0, 2, 0),
)


@dataclass(frozen=True)
class Target:
    url: str
    pid: int | None  # None: the GPU itself, whose CPU is not measured
    idle_cpu: float = 0.0  # CPU seconds a second with only the probe polling
    idle_loop: float = 0.0  # the same, of the event loop's thread alone


def body(shape: Shape, rng: random.Random, corpus: Corpus) -> bytes:
    """One unique chat of `shape`: a nonce leads it, so it shares no prefix with another."""
    if shape.tokens:
        text = f"{nonce(rng)} {corpus.text(rng, shape.tokens)}"
        messages = [{"role": "user", "content": text}]
    else:
        messages = [{"role": "system", "content": f"{nonce(rng)} {corpus.sentence(rng)}"}]
        messages += [
            {"role": ("user", "assistant")[i % 2], "content": corpus.sentence(rng)[:120]}
            for i in range(CHAT_MESSAGES - 1)
        ]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": ANSWER_TOKENS}).encode()


def loop_cpu(pid: int) -> float:
    """CPU seconds of the process's main thread, where `sluice serve` runs its event loop."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_now(pid: int | None) -> tuple[float, float]:
    """(process tree, loop thread) CPU seconds; zeros for a target not measured."""
    return (tree_cpu(pid), loop_cpu(pid)) if pid else (0.0, 0.0)


def stage_seconds(samples: dict[str, float]) -> dict[str, dict[str, float]]:
    """{cause: {stage: seconds}} from a scrape of `sluice_event_loop_stall_stage_seconds`."""
    found: dict[str, dict[str, float]] = {}
    for key, value in samples.items():
        if key.startswith(STAGE_SUM + "{"):
            labels = dict(LABEL.findall(key))
            found.setdefault(labels["cause"], {})[labels["stage"]] = value
    return found


def stage_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """What stalled between two scrapes, by cause and stage (nothing left at zero)."""
    delta: dict[str, dict[str, float]] = {}
    for cause, stages in after.items():
        for stage, seconds in stages.items():
            added = seconds - before.get(cause, {}).get(stage, 0.0)
            if added > 0:
                delta.setdefault(cause, {})[stage] = added
    return delta


async def idle(url: str, pid: int) -> Target:
    """`url`'s CPU a second with nothing but the probe polling /health, to subtract."""
    async with harness.health_probe(url, PROBE_INTERVAL_S):
        await trio.sleep(0.5)  # the probe's first polls and connection are not idle
        cpu0, started = cpu_now(pid), trio.current_time()
        await trio.sleep(IDLE_S)
        cpu1, seconds = cpu_now(pid), trio.current_time() - started
    return Target(url, pid, (cpu1[0] - cpu0[0]) / seconds, (cpu1[1] - cpu0[1]) / seconds)


async def one_round(target: Target, bodies: Sequence[bytes]) -> dict[str, Any]:
    """The clients send `bodies` (built before: not the target's time) until none is left."""
    pool = Pool(target.url)
    items = [Prepared("long", False, encode(pool.netloc, "POST", CHAT, b)) for b in bodies]
    before = await harness.scrape(target.url) if target.pid else {}
    async with harness.health_probe(target.url, PROBE_INTERVAL_S) as probe:
        cpu0 = cpu_now(target.pid)
        run = await drive.closed_loop(pool, CLIENTS, items)
        cpu1 = cpu_now(target.pid)
    await pool.close()
    after = await harness.scrape(target.url) if target.pid else {}
    ok = max(run.ok, 1)
    measured = target.pid is not None
    nan = float("nan")
    cpu = cpu1[0] - cpu0[0] - target.idle_cpu * run.seconds
    loop = cpu1[1] - cpu0[1] - target.idle_loop * run.seconds
    stalls = stage_delta(stage_seconds(before), stage_seconds(after))
    counted = [int(t) for t in (r.prompt_tokens or "" for r in run.records) if t.isdigit()]
    return {
        "requests": len(run.records),
        "errors": run.errors,
        "requests_per_s": run.ok / run.seconds,
        "cpu_ms_per_request": cpu / ok * 1e3 if measured else nan,
        "loop_ms_per_request": loop / ok * 1e3 if measured else nan,
        "health_p50_ms": probe["p50_s"] * 1e3,
        "health_p99_ms": probe["p99_s"] * 1e3,
        "health_max_ms": probe["worst_s"] * 1e3,
        "stall_s": stalls,
        "prompt_tokens": statistics.mean(counted) if counted else nan,
    }


def over_direct(rows: list[dict[str, Any]], variant: str) -> list[float]:
    """`variant`'s req/s over direct's in the same round: median, low, high."""
    return [1 + c / 100 for c in paired_change(rows, "requests_per_s", variant, "direct")]


def stall_ms_per_request(rows: list[dict[str, Any]], variant: str) -> dict[str, dict[str, float]]:
    """{cause: {stage: ms}}: `variant`'s stall time of all rounds per request (stalls are
    rare events: pooled, not a median of mostly zeros)."""
    own = [r for r in rows if r["variant"] == variant]
    requests = sum(r["requests"] - r["errors"] for r in own) or 1
    stalls: dict[str, dict[str, float]] = {}
    for row in own:
        for cause, stages in row["stall_s"].items():
            for stage, seconds in stages.items():
                by_stage = stalls.setdefault(cause, {})
                by_stage[stage] = by_stage.get(stage, 0.0) + seconds * 1e3 / requests
    return stalls


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians by target; this checkout's Sluice (`sluice`) over direct by round and its
    stalls per request (another version's, when comparing, are read off the rounds)."""
    sluice = [r for r in rows if r["variant"] == "sluice"]
    counted = [r["prompt_tokens"] for r in sluice if not math.isnan(r["prompt_tokens"])]
    return {
        "summary": by_group(rows, "variant", COLUMNS, ("health_max_ms",)),
        "sluice_over_direct": over_direct(rows, "sluice"),
        "stall_ms_per_request": stall_ms_per_request(rows, "sluice"),
        "prompt_tokens": round(statistics.mean(counted)) if counted else None,
        "rounds": rows,
    }


async def measure(bench: Bench) -> dict[str, Any]:
    rounds = bench.rounds(1, 3)
    shapes = [s for s in SHAPES if bench.pick(s.quick_per_client, s.per_client)]
    sim = await bench.stack.sim(*SIM_FLAGS)
    proxies = await bench.proxies("sluice", sim, *WINDOW)  # and sluice@REV when comparing
    for url in (sim, *proxies.values()):
        await harness.wait_healthy(url)
    targets = {"direct": Target(sim, None)}
    for variant, url in proxies.items():
        targets[variant] = await idle(url, bench.stack.pids[url])
    corpus = Corpus.default()
    result: dict[str, Any] = {"rounds": rounds, "clients": CLIENTS, "shapes": {}}
    for shape in shapes:
        per_client = bench.pick(shape.quick_per_client, shape.per_client)

        async def one(
            variant: str, number: int, shape: Shape = shape, per_client: int = per_client
        ) -> dict[str, Any]:
            rng = random.Random(f"{shape.name}/{variant}/{number}")
            bodies = [body(shape, rng, corpus) for _ in range(CLIENTS * per_client)]
            return await one_round(targets[variant], bodies)

        rows = await bench.alternate(rounds, list(targets), one, f" {shape.name}")
        result["shapes"][shape.name] = {"per_client": per_client, **summarize(rows)}
    return result


def per_10k_tokens(ms: float, tokens: float | None) -> float | None:
    return ms / tokens * 10_000 if tokens else None


def sluices(blob: dict[str, Any]) -> dict[str, str]:
    """{Sluice variant: its label beside a shape's name}: the shape's alone for one Sluice,
    with the variant's name when two versions are compared."""
    variants = [v for v in blob["summary"] if v != "direct"]
    return {v: f" ({v})" if len(variants) > 1 else "" for v in variants}


def main_row(label: str, blob: dict[str, Any], variant: str) -> list[Any]:
    direct, sluice = blob["summary"]["direct"], blob["summary"][variant]
    tokens = blob["prompt_tokens"]
    stalls = stall_ms_per_request(blob["rounds"], variant)
    stalled = sum((sum(v.values()) for v in stalls.values()), 0.0)
    return [
        label, f"{tokens:,}" if tokens else None, with_range(direct, "requests_per_s"),
        with_range(sluice, "requests_per_s"), Ranged(*over_direct(blob["rounds"], variant)),
        with_range(sluice, "cpu_ms_per_request"), with_range(sluice, "loop_ms_per_request"),
        per_10k_tokens(sluice["loop_ms_per_request"], tokens),
        with_range(sluice, "health_p50_ms"), with_range(sluice, "health_p99_ms"),
        sluice["health_max_ms"],
        f"{direct['health_p99_ms']:.1f} / {direct['health_max_ms']:.1f}", stalled,
        direct["errors"] + sluice["errors"],
    ]  # fmt: skip


def main_table(result: dict[str, Any]) -> Table:
    rows = []
    for name, blob in result["shapes"].items():
        for variant, label in sluices(blob).items():
            rows.append(main_row(name + label, blob, variant))
    return Table(
        f"{result['clients']} closed-loop clients, unique chats on a GPU's timing; medians of "
        f"{result['rounds']} alternating round(s) (range); x direct: Sluice's req/s over "
        "direct's in the same round; Sluice's CPU per request above idle, of the process with "
        "its render workers and of its event loop's thread (loop); /health every 10 ms from a "
        "probe process (max: over the rounds); stalls: the detector's, all rounds",
        ["shape", "tokens", "direct req/s", "Sluice req/s", "x direct", "CPU ms/req",
         "loop ms/req", "loop ms/10k tok", "/health p50 ms", "p99 ms", "max ms",
         "direct /health p99 / max", "stalls ms/req", "errors"],
        rows,
        digits=2,
    )  # fmt: skip


def stage_rows(stalls: dict[str, dict[str, float]]) -> dict[str, float]:
    """{row: ms per request}: `blocking` stalls by stage, the others by cause alone (the GIL
    or the OS stalled the loop, not the stage it was in: app/observe/stall_causes.py)."""
    rows = dict(stalls.get(BLOCKING, {}))
    for cause, stages in stalls.items():
        if cause != BLOCKING:
            rows[f"({cause}, any stage)"] = sum(stages.values())
    return rows


def stage_table(result: dict[str, Any]) -> Table:
    shapes = {
        name + label: stage_rows(stall_ms_per_request(blob["rounds"], variant))
        for name, blob in result["shapes"].items()
        for variant, label in sluices(blob).items()
    }
    names = sorted(
        {n for rows in shapes.values() for n in rows},
        key=lambda n: (n.startswith("("), -sum(rows.get(n, 0.0) for rows in shapes.values())),
    )
    return Table(
        "Sluice's event loop stalled (task steps over the detector's threshold), ms per "
        "request over all rounds: blocking stalls by stage (the innermost frame of Sluice's "
        "code on the stall's stack, else its phase), the others by cause"
        + ("" if names else ": no stall at all"),
        ["stage", *shapes],
        [[n, *(rows.get(n, 0.0) for rows in shapes.values())] for n in names],
        digits=2,
    )


def tables(result: dict[str, Any]) -> list[Table]:
    return [main_table(result), stage_table(result)]


def plot(result: dict[str, Any], png: Path) -> None:
    shapes = result["shapes"]
    series = {
        f"{variant} {what}": [b["summary"][variant][column] for b in shapes.values()]
        for variant in ("direct", "sluice")
        for what, column in (("p99", "health_p99_ms"), ("max", "health_max_ms"))
    }
    plot_bars("GET /health while long prompts are served", list(shapes), series, "ms", png)


SCENARIO = Scenario(
    name="longprompts",
    reproduces="issue 34",
    about="unique 8k-128k-token prompts and 3,000-message chats on a GPU's timing",
    reference=(
        "DESIGN.md: with a GPU's timing one core keeps up (0.98x direct on unique 40k-token\n"
        "prompts); a unique ~40k-token prompt blocks the loop 8-18 ms (JSON, block hashing,\n"
        "index records): /health p99 ~19-23 ms during a burst of them, ~7 ms idle."
    ),
    measure=measure,
    tables=tables,
    plot=plot,
)
