"""`python -m load bench hardening`: the loop under hostile traffic (issue 7).

One instant simulated backend and `sluice serve` processes in front of it; while each part
runs, a probe in a process of its own sends GET /health every millisecond on one keep-alive
connection: its worst latency is how long the proxy's loop froze, as a client sees it. The
stalls column is the proxy's own detector, by cause.

- long-chats: each of 3 clients sends unique conversations of 1,500-4,000 short messages,
  one after the other; `inline` (the naive baseline: parse, render and encode on the loop)
  and `offload` (the default) alternate by round. Target: offload's worst /health <= 10 ms.
- huge-prompt: a 12 MB chat message against the backend's 131,072-token window. Targets:
  refused (400 context_length_exceeded) within 0.5 s; worst /health <= 10 ms. (The naive
  baseline is not run: it encodes all 2.9 M tokens, 7-42 s here.)
- streams: 1,000 streaming chats opened at once. Target: every one ends with `[DONE]`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from load import client, harness
from load.client import CHAT, Pool
from load.harness import Bench, Scenario, Table
from load.stats import by_group, with_range
from load.workloads import Corpus

PARTS = ("long-chats", "huge-prompt", "streams")
PROBE_INTERVAL_S = 0.001
TIMEOUT_S = 120.0
CLIENTS = 3
HUGE_PROMPT_BYTES = 12_000_000
STREAMS = 1000
TARGET_WORST_MS, TARGET_REFUSAL_S = 10.0, 0.5
STALLS = "sluice_event_loop_stalls_total"


def conversation(rng: random.Random, corpus: Corpus) -> bytes:
    messages = [{"role": "system", "content": f"conversation {rng.getrandbits(64):016x}"}]
    for i in range(rng.randint(1500, 4000)):
        text = corpus.sentence(rng)[: rng.randint(20, 120)]
        messages.append({"role": ("user", "assistant")[i % 2], "content": text})
    return json.dumps({"model": "sim", "messages": messages, "max_tokens": 1}).encode()


def post(pool: Pool, body: bytes) -> bytes:
    return client.encode(pool.netloc, "POST", CHAT, body)


async def under_probe(url: str, load: Callable[[], Awaitable[str]]) -> dict[str, Any]:
    """Run `load` (which returns a one-line result) while the probe process polls /health."""
    before = harness.label_values(await harness.scrape(url), STALLS, "cause")
    with trio.fail_after(TIMEOUT_S):
        async with harness.health_probe(url, PROBE_INTERVAL_S) as probe:
            started = time.perf_counter()
            detail = await load()
            wall = time.perf_counter() - started
    after = harness.label_values(await harness.scrape(url), STALLS, "cause")
    stalls = {cause: n - before.get(cause, 0.0) for cause, n in after.items()}
    return {
        "wall_s": wall,
        "health_worst_ms": probe["worst_s"] * 1e3,
        "health_p99_ms": probe["p99_s"] * 1e3,
        "probes": probe["probes"],
        "probe_failures": probe["failures"],
        "stalls": ", ".join(f"{c}:{n:g}" for c, n in sorted(stalls.items()) if n) or "none",
        "result": detail,
    }


async def long_chats(pool: Pool, bodies: list[list[bytes]]) -> str:
    """Each client sends its conversations one after the other."""
    statuses: list[int] = []

    async def one_client(chats: list[bytes]) -> None:
        for body in chats:
            statuses.append((await pool.send(post(pool, body))).status)

    async with trio.open_nursery() as nursery:
        for chats in bodies:
            nursery.start_soon(one_client, chats)
    return f"{statuses.count(200)}/{len(statuses)} answered 200"


def huge_body(seed: int) -> bytes:
    text = Corpus.default().text(random.Random(seed), HUGE_PROMPT_BYTES // 4)
    return json.dumps({"model": "sim", "messages": [{"role": "user", "content": text}]}).encode()


async def huge_prompt(pool: Pool, body: bytes) -> str:
    reply = await pool.send(post(pool, body))
    code = reply.json().get("error", {}).get("code") if reply.status != 200 else ""
    return f"{reply.status} {code}"


async def streams(url: str, count: int) -> str:
    """`count` streaming chats at once, each on a new connection."""
    finished: list[bool] = []

    async def one(pool: Pool, number: int) -> None:
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": f"stream {number}"}],
            "stream": True,
            "max_tokens": 16,
        }
        ended = False
        try:
            connection = await pool.start(post(pool, json.dumps(body).encode()))
            try:
                async for line in client.Lines(connection):
                    ended = ended or line == b"data: [DONE]"
            finally:
                await pool.finish(connection)
        except client.ERRORS:
            ended = False
        finished.append(ended)

    async with Pool(url) as pool, trio.open_nursery() as nursery:
        for number in range(count):
            nursery.start_soon(one, pool, number)
    return f"{finished.count(True)}/{count} ended with [DONE]"


async def measure(bench: Bench) -> dict[str, Any]:
    parts = bench.args.part or list(PARTS)
    rounds, chats = bench.rounds(1, 3), bench.pick(1, 4)
    sim = await bench.stack.sim(instant=True)
    urls: dict[str, str] = {}
    if not bench.comparing:  # the naive baseline: left out when comparing two versions
        urls["inline"] = await bench.stack.proxy(sim, "--tokenize-mode", "inline")
    urls |= await bench.proxies("offload", sim, "--tokenize-mode", "offload")
    pools = {mode: Pool(url) for mode, url in urls.items()}
    result: dict[str, Any] = {}
    for url in urls.values():
        await harness.wait_healthy(url)
    for part in parts:
        modes = [m for m in urls if m != "inline" or part == "long-chats"]

        async def one(mode: str, number: int, part: str = part) -> dict[str, Any]:
            url, pool = urls[mode], pools[mode]
            if part == "long-chats":  # built before the probe starts: not the proxy's time
                rng, corpus = random.Random(number), Corpus.default()
                bodies = [[conversation(rng, corpus) for _ in range(chats)] for _ in range(CLIENTS)]
                return await under_probe(url, lambda: long_chats(pool, bodies))
            if part == "huge-prompt":
                body = huge_body(number)
                return await under_probe(url, lambda: huge_prompt(pool, body))
            return await under_probe(url, lambda: streams(url, STREAMS))

        rows = await bench.alternate(rounds, modes, one, f" {part}")
        summary = by_group(rows, "variant", ("wall_s", "health_p99_ms"), ("health_worst_ms",))
        result[part] = {"summary": summary, "rounds": rows}
    for pool in pools.values():
        await pool.close()
    return result


def all_done(results: list[str]) -> bool:
    """Every round's "12/12 answered 200" or "1000/1000 ended with [DONE]" is whole."""
    counts = [r.split()[0].split("/") for r in results]
    return all(len(c) == 2 and c[0] == c[1] for c in counts)


def summary(result: dict[str, Any]) -> Table:
    rows = []
    for part, blob in result.items():
        for mode, s in blob["summary"].items():
            rounds = [r for r in blob["rounds"] if r["variant"] == mode]
            results = [r["result"] for r in rounds]
            stalled = [r["stalls"] for r in rounds if r["stalls"] != "none"]
            wall = max(r["wall_s"] for r in rounds)
            met = None
            if mode.startswith("offload"):  # offload@REV too, when comparing versions
                met = s["health_worst_ms"] <= TARGET_WORST_MS and (
                    wall <= TARGET_REFUSAL_S and all(r.startswith("400 ") for r in results)
                    if part == "huge-prompt"
                    else all_done(results)
                )
            stalls = f"{len(stalled)} of {len(rounds)}" + (
                f": {', '.join(dict.fromkeys(stalled))}" * bool(stalled)
            )
            rows.append(
                [part, mode, len(rounds), wall, s["health_worst_ms"],
                 with_range(s, "health_p99_ms"), stalls, " / ".join(dict.fromkeys(results)), met]
            )  # fmt: skip
    return Table(
        f"GET /health every {PROBE_INTERVAL_S * 1e3:g} ms from a probe process while each part "
        "runs; worst: over the rounds, p99: their median (range); issue 7's targets: offload's "
        f"worst /health <= {TARGET_WORST_MS:g} ms in each part, the 12 MB prompt refused in <= "
        f"{TARGET_REFUSAL_S:g} s, every chat answered and every stream ended with [DONE]",
        ["part", "mode", "rounds", "wall s (worst)", "/health worst ms", "/health p99 ms",
         "rounds with stalls", "result", "targets met"],
        rows,
        digits=2,
    )  # fmt: skip


def tables(result: dict[str, Any]) -> list[Table]:
    out = [summary(result)]
    for part, blob in result.items():
        rows = [
            [r["round"], r["variant"], r["wall_s"], r["health_worst_ms"], r["health_p99_ms"],
             r["probes"], r["stalls"], r["result"]]
            for r in blob["rounds"]
        ]  # fmt: skip
        offload = blob["summary"]["offload"]
        verdict = (
            f"offload worst /health {offload['health_worst_ms']:.1f} ms "
            f"(target <= {TARGET_WORST_MS:g} ms)"
        )
        if "inline" in blob["summary"]:
            ratio = blob["summary"]["inline"]["health_worst_ms"] / offload["health_worst_ms"]
            verdict += f"; inline / offload worst {ratio:.1f}x"
        if part == "huge-prompt":
            slowest = max(r["wall_s"] for r in blob["rounds"])
            verdict += f"; refused in {slowest:.2f} s at worst (target <= {TARGET_REFUSAL_S:g} s)"
        out.append(
            Table(
                f"{part}: GET /health every {PROBE_INTERVAL_S * 1e3:g} ms while loaded; {verdict}",
                ["round", "mode", "wall s", "/health worst ms", "p99 ms", "probes", "stalls",
                 "result"],
                rows,
                digits=2,
            )
        )  # fmt: skip
    return out


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--part", action="append", choices=PARTS, help="one part only (repeatable; default all)"
    )


SCENARIO = Scenario(
    name="hardening",
    reproduces="issue 7",
    about="long chats, a 12 MB prompt, 1,000 streams at once: the loop meanwhile",
    reference=(
        "issue 7 saw: long-chats worst /health 66-100 ms then SIGSEGV; a 12 MB prompt took\n"
        "7-42 s to refuse with /health at 87-694 ms; 1,000 streams at once 20-30% reset.\n"
        "Targets: worst /health <= 10 ms in each; the 12 MB prompt refused in <= 0.5 s;\n"
        "1,000/1,000 streams end with [DONE]."
    ),
    measure=measure,
    tables=tables,
    options=options,
)
