"""`python -m load bench replicas`: Sluice replicas routing as one (issue 17).

Four simulated GPUs (the routing scenario's profile) publish their KV events; 1, 2 and 4
Sluice replicas (separate `sluice serve` processes, `--policy cache_aware`) sit behind a round
robin of TCP connections (what a Kubernetes Service does), with `--kv-events` for every GPU or
without; the routing scenario's seeded workloads (rag, chat, hot: load/routing_workloads.py)
go through the round robin. Before each run the GPUs' caches are emptied (`POST /sim/evict`),
and the prefix hit rate is the GPUs' own counters' (`vllm:prefix_cache_hits / queries`) over
the run. The GPUs see the token ids Sluice sees, as a vLLM serving the model Sluice
tokenizes for does: they tokenize with Sluice's tokenizer (`--tokenize-with default`) and
the replicas send them the ids of the prompt they rendered (`--forward tokens`). Their KV
events then name blocks of those ids; before 2026-11-26 the GPUs split words and rendered
their own stand-in template, so no event could match a block any replica routed, and "with
events" measured little more than prediction. Within a workload the variants take turns:
events on with 1, 2, 4 replicas, then events off with 4, 2, 1 (the order reversed every
other round with `--rounds`), on GPUs started afresh for each round (`Placements`). TTFT
p99 is given over the whole run and over the requests sent after its first quarter
("warm"): the cold start (every prompt a miss on empty GPUs) decides the first, and varies
by +-20% from run to run of the same variant; the second is the steady state the replicas
settle in.

Budgets: 4 replicas with `--redis-url` (a redis-server of our own, fresh for each run) and one
API key's `--tokens-per-minute`; clients ask for about seven times the budget; admitted tokens
(usage of the answered requests) against what the budget allows over the run's length (one
minute's worth plus the refill), beside the same 4 replicas without Redis. Then Redis is
killed halfway through a run below the budget: every request must still be answered. And
`POST /sim/evict` on a GPU: how soon one replica's index has learned it (`AllBlocksCleared`).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from itertools import count
from pathlib import Path
from typing import Any

import trio

from load import harness
from load.bench.routing import RATES, SIM_PROFILE, drive
from load.client import CHAT, FAILURES, Pool, call
from load.harness import Bench, Scenario, Table
from load.plots import plot_line_panels
from load.processes import Stack, free_port
from load.routing_workloads import MODEL
from load.stats import percentile

BACKENDS = 4
REPLICAS = (1, 2, 4)
WORKLOADS = ("rag", "chat", "hot")
LEAN = (
    "--policy", "cache_aware", "--forward", "tokens",
    "--render-workers", "1", "--tokenize-threads", "1",
)  # fmt: skip
BUDGET = 60_000  # tokens a minute for the one key
BUDGET_CLIENTS = 6
BUDGET_PACE_S = 0.6  # 6 clients, ~716 tokens each every 0.6 s: ~430k tokens a minute, 7x
WITH_REDIS, WITHOUT_REDIS = "with Redis", "without Redis"
EVICTION_GIVE_UP_S = 10.0
Sims = list[tuple[str, str]]  # (URL, KV events endpoint) of each simulated GPU


class RoundRobin:
    """A TCP round robin: each new connection goes to the next replica, as a Service does."""

    def __init__(self, targets: Sequence[str]) -> None:
        self.ports = [int(url.rsplit(":", 1)[1]) for url in targets]
        self._next = count()
        self.url = ""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=1024)
        self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        task_status.started()
        await trio.serve_listeners(self._relay, listeners)

    async def _relay(self, client: trio.SocketStream) -> None:
        port = self.ports[next(self._next) % len(self.ports)]
        try:
            upstream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            await client.aclose()
            return
        async with client, upstream, trio.open_nursery() as nursery:
            nursery.start_soon(_pump, client, upstream, nursery.cancel_scope)
            nursery.start_soon(_pump, upstream, client, nursery.cancel_scope)


async def _pump(source: trio.SocketStream, sink: trio.SocketStream, done: trio.CancelScope) -> None:
    try:
        while data := await source.receive_some(65536):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    done.cancel()


@asynccontextmanager
async def round_robin(targets: Sequence[str]) -> AsyncIterator[str]:
    """The round robin's URL while the body runs."""
    balancer = RoundRobin(targets)
    async with trio.open_nursery() as nursery:
        await nursery.start(balancer.run)
        yield balancer.url
        nursery.cancel_scope.cancel()


async def start_sims(stack: Stack) -> Sims:
    sims: dict[int, tuple[str, str]] = {}

    async def start_one(seed: int) -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        flags = (
            "--seed", str(seed), *SIM_PROFILE, "--tokenize-with", "default",
            "--kv-events-endpoint", endpoint,
        )  # fmt: skip
        url = await stack.sim(*flags, model=MODEL)
        sims[seed] = (url, endpoint)

    async with trio.open_nursery() as nursery:  # at once, as the replicas
        for seed in range(BACKENDS):
            nursery.start_soon(start_one, seed)
    return [sims[seed] for seed in range(BACKENDS)]


class Placements:
    """Fresh simulated GPUs for each round. Their URLs (random free ports) are the names
    rendezvous hashing places prefixes by, so one set of GPUs is one draw of where the
    workload's prefixes land (five of rag's eight on one GPU happens); new GPUs each round
    average the result over draws instead of repeating one."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.round: int | None = None
        self.sims: Sims = []

    async def for_round(self, number: int) -> Sims:
        if number != self.round:
            for url, _ in self.sims:
                self.stack.kill(url)
            self.sims = await start_sims(self.stack)
            self.round = number
        return self.sims


async def start_replicas(
    stack: Stack,
    sims: Sims,
    replicas: int,
    events: bool,
    extra: Sequence[str] = (),
    source: Path | None = None,
) -> list[str]:
    """`replicas` proxies in front of `sims`, started at once; `source`: another version's
    `app/` to run (`python -m load compare --replicas`)."""
    flags = list(LEAN)
    if events:
        for url, endpoint in sims:
            flags += ["--kv-events", f"{url}={endpoint}"]
    backends = [url for url, _ in sims]
    urls: list[str] = []

    async def start_one() -> None:
        url = await stack.proxy(backends, *flags, *extra, source=source)
        await harness.wait_healthy(url)
        urls.append(url)

    async with trio.open_nursery() as nursery:  # at once: a start is mostly imports
        for _ in range(replicas):
            nursery.start_soon(start_one)
    return urls


async def gpu_counters(sims: Sims) -> tuple[float, float]:
    hits = queries = 0.0
    for url, _ in sims:
        samples = await harness.scrape(url)
        hits += harness.metric(samples, "vllm:prefix_cache_hits_total") or 0.0
        queries += harness.metric(samples, "vllm:prefix_cache_queries_total") or 0.0
    return hits, queries


async def fleet_run(
    sims: Sims,
    replicas: int,
    events: bool,
    workload: str,
    duration: float,
    proxy_flags: Sequence[str] = (),
    source: Path | None = None,
) -> dict[str, Any]:
    """One run of `workload` through `replicas` proxies behind a round robin, on GPUs whose
    caches were emptied first: the GPUs' own prefix hit rate and the clients' TTFT."""
    for url, _ in sims:
        (await call(url + "/sim/evict", "POST")).raise_for_status()
    async with Stack(proxy_flags) as stack:
        urls = await start_replicas(stack, sims, replicas, events, source=source)
        async with round_robin(urls) as url:
            before = await gpu_counters(sims)
            samples = await drive(url, workload, duration, seed=0)
            after = await gpu_counters(sims)
    queries = after[1] - before[1]
    return {
        "workload": workload,
        "replicas": replicas,
        "events": events,
        "answered": len(samples.ttft) - samples.censored,
        "errors": samples.errors + samples.censored,
        "hit_rate": (after[0] - before[0]) / queries if queries else 0.0,
        "ttft_p50_ms": percentile(samples.ttft, 50) * 1000,
        "ttft_p99_ms": percentile(samples.ttft, 99) * 1000,
        "ttft_p99_warm_ms": percentile(samples.ttft_sent_after(duration / 4), 99) * 1000,
    }


async def closed_loop(url: str, duration: float, pace: float) -> dict[str, Any]:
    """BUDGET_CLIENTS clients with one key, each a request every `pace` seconds at most."""
    tallies = {"admitted_tokens": 0, "answered": 0, "refused": 0, "failed": 0}
    words = "budget " * 700  # ~700 prompt tokens (the simulated GPU counts words)
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 16}
    headers = {"authorization": "Bearer one-key"}

    async def client_loop() -> None:
        async with Pool(url, headers, timeout=30) as pool:
            deadline = trio.current_time() + duration
            while trio.current_time() < deadline:
                started = trio.current_time()
                try:
                    response = await pool.call("POST", CHAT, json_body=body)
                except FAILURES:
                    tallies["failed"] += 1
                else:
                    if response.status == 200:
                        usage = response.json()["usage"]
                        tallies["answered"] += 1
                        tallies["admitted_tokens"] += usage["prompt_tokens"]
                        tallies["admitted_tokens"] += usage["completion_tokens"]
                    elif response.status == 429:
                        tallies["refused"] += 1
                    else:
                        tallies["failed"] += 1
                await trio.sleep_until(started + pace)

    async with trio.open_nursery() as nursery:
        for _ in range(BUDGET_CLIENTS):
            nursery.start_soon(client_loop)
    return tallies


async def budget_run(bench: Bench, sims: Sims, redis: bool, duration: float) -> dict[str, Any]:
    async with Stack(bench.args.proxy_arg) as stack:
        extra = ["--tokens-per-minute", str(BUDGET)]
        if redis:
            extra += ["--redis-url", await stack.redis(), "--budget-sync-interval", "0.2"]
        urls = await start_replicas(stack, sims, 4, events=True, extra=extra)
        async with round_robin(urls) as url:
            started = time.monotonic()
            tallies = await closed_loop(url, duration, BUDGET_PACE_S)
            elapsed = time.monotonic() - started
    allowed = BUDGET * (1 + elapsed / 60.0)
    return {
        "redis": redis,
        "seconds": elapsed,
        "budget_per_minute": BUDGET,
        "allowed_tokens": allowed,
        **tallies,
        "admitted_vs_allowed": tallies["admitted_tokens"] / allowed,
    }


async def redis_killed_run(bench: Bench, sims: Sims, duration: float) -> dict[str, Any]:
    """Below the budget, Redis killed halfway: every request answered (no 5xx, no error)."""
    async with Stack(bench.args.proxy_arg) as stack:
        redis = await stack.redis()
        extra = ["--tokens-per-minute", str(BUDGET * 10), "--redis-url", redis]
        urls = await start_replicas(stack, sims, 4, events=True, extra=extra)
        async with round_robin(urls) as url, trio.open_nursery() as nursery:

            async def kill_halfway() -> None:
                await trio.sleep(duration / 2)
                stack.kill(redis)

            nursery.start_soon(kill_halfway)
            tallies = await closed_loop(url, duration, pace=0.5)
    return {"redis_killed_at_s": duration / 2, **tallies}


async def eviction_run(bench: Bench, sims: Sims, trials: int) -> dict[str, Any]:
    """How soon after `POST /sim/evict` a replica's index has it: the time until the proxy's
    `cleared` count moves (polled on its /metrics, so an upper bound), `trials` times."""
    url, endpoint = sims[0]
    prompt = [{"role": "user", "content": "evict " * 300}]
    body: dict[str, Any] = {"model": MODEL, "messages": prompt, "max_tokens": 2}
    pattern = re.compile(r'sluice_kv_events_applied_total\{backend="[^"]+",type="cleared"\} (\S+)')
    learned_ms: list[float] = []
    async with Stack(bench.args.proxy_arg) as stack:
        proxy = Pool(await stack.proxy([url], "--kv-events", f"{url}={endpoint}"), timeout=10)

        async def cleared() -> float:
            match = pattern.search((await proxy.call("GET", "/metrics")).text)
            return float(match.group(1)) if match else 0.0

        for _ in range(trials):
            (await proxy.call("POST", CHAT, json_body=body)).raise_for_status()
            before = await cleared()
            started = time.perf_counter()
            (await call(url + "/sim/evict", "POST")).raise_for_status()
            with trio.fail_after(EVICTION_GIVE_UP_S):  # never learned: an error, not a hang
                while await cleared() == before:
                    pass
            learned_ms.append((time.perf_counter() - started) * 1000)
        await proxy.close()
    return {"trials": trials, "p50_ms": percentile(learned_ms, 50), "max_ms": max(learned_ms)}


def label(replicas: int, events: bool) -> str:
    return f"{replicas} replica{'s' if replicas > 1 else ''}, events {'on' if events else 'off'}"


async def measure(bench: Bench) -> dict[str, Any]:
    duration = bench.pick(5.0, 20.0)
    counts: tuple[int, ...] = bench.pick((1, 4), REPLICAS)
    variants = {
        label(replicas, events): (replicas, events)
        for events in bench.pick((True,), (True, False))
        for replicas in (counts if events else reversed(counts))
    }
    placements = Placements(bench.stack)
    routing: list[dict[str, Any]] = []
    for workload in bench.pick(("rag",), WORKLOADS):

        async def one(variant: str, number: int, workload: str = workload) -> dict[str, Any]:
            replicas, events = variants[variant]
            sims = await placements.for_round(number)
            return await fleet_run(sims, replicas, events, workload, duration, bench.args.proxy_arg)

        routing += await bench.alternate(bench.rounds(1, 1), list(variants), one, f" {workload}")

    sims = placements.sims  # the last round's

    async def budget(variant: str, _: int) -> dict[str, Any]:
        return await budget_run(bench, sims, variant == WITH_REDIS, bench.pick(8.0, 30.0))

    budget_variants = bench.pick((WITH_REDIS,), (WITH_REDIS, WITHOUT_REDIS))
    budgets = await bench.alternate(bench.rounds(1, 1), budget_variants, budget, " budgets")
    harness.progress(f"{bench.name}: evictions")
    eviction = await eviction_run(bench, sims, bench.pick(5, 20))
    harness.progress(f"{bench.name}: Redis killed mid-run")
    killed = await redis_killed_run(bench, sims, bench.pick(6.0, 20.0))
    harness.progress("")
    result = {"duration_s": duration, "routing": routing, "budgets": budgets}
    result["redis_killed"] = killed
    result["eviction"] = eviction
    result["targets"] = targets(result)
    return result


def mean_of(runs: Sequence[dict[str, Any]], key: str, **match: Any) -> float | None:
    """The mean of `key` over the runs (rounds) whose fields equal `match`."""
    values = [r[key] for r in runs if all(r[k] == v for k, v in match.items())]
    return sum(values) / len(values) if values else None


def targets(result: dict[str, Any]) -> list[str]:
    """Issue 17's targets, checked on the mean of the rounds."""
    lines = []

    def check(text: str, ok: bool) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'} {text}")

    runs = result["routing"]
    for workload in sorted({r["workload"] for r in runs}):
        for events, ratio in ((True, 0.98), (False, 0.95)):
            one_hit = mean_of(runs, "hit_rate", workload=workload, replicas=1, events=events)
            four_hit = mean_of(runs, "hit_rate", workload=workload, replicas=4, events=events)
            if one_hit is None or four_hit is None:
                continue
            name = "events" if events else "no events"
            got = four_hit / one_hit if one_hit else 0.0
            hit = f"{workload}, {name}: 4 replicas' hit rate {got:.3f}x one's >= {ratio}"
            check(hit, got >= ratio)
            for key, what in (("ttft_p99_ms", "p99 TTFT"), ("ttft_p99_warm_ms", "warm p99 TTFT")):
                one_p99 = mean_of(runs, key, workload=workload, replicas=1, events=events)
                four_p99 = mean_of(runs, key, workload=workload, replicas=4, events=events)
                assert one_p99 is not None and four_p99 is not None
                p99 = four_p99 / one_p99
                check(f"{workload}, {name}: 4 replicas' {what} {p99:.2f}x one's <= 1.1", p99 <= 1.1)
        with_ = mean_of(runs, "hit_rate", workload=workload, replicas=1, events=True)
        without = mean_of(runs, "hit_rate", workload=workload, replicas=1, events=False)
        if with_ is not None and without is not None:
            check(
                f"{workload}: 1 replica with events {with_:.3f} >= without {without:.3f}",
                with_ >= without,
            )
    for run in result["budgets"]:
        if run["redis"]:
            ratio = run["admitted_vs_allowed"]
            check(f"4 replicas with Redis admit {ratio:.3f}x the budget <= 1.1", ratio <= 1.1)
    eviction = result.get("eviction")
    if eviction:
        learned = eviction["max_ms"]
        check(f"an eviction learned within {learned:.1f} ms (worst) <= 100", learned <= 100)
    killed = result.get("redis_killed")
    if killed:
        check(
            f"Redis killed mid-run: {killed['failed']} failed requests == 0", killed["failed"] == 0
        )
    return lines


def tables(result: dict[str, Any]) -> list[Table]:
    runs, budgets, killed = result["routing"], result["budgets"], result["redis_killed"]
    counts = sorted({r["replicas"] for r in runs})
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        for events in dict.fromkeys(r["events"] for r in runs if r["workload"] == workload):
            match = {"workload": workload, "events": events}

            def cell(key: str, form: str, match: dict[str, Any] = match) -> str:
                means = [mean_of(runs, key, replicas=n, **match) for n in counts]
                return " / ".join("-" if m is None else format(m, form) for m in means)

            errors = sum(r["errors"] for r in runs if r["workload"] == workload)
            rows.append(
                [workload, "on" if events else "off", cell("hit_rate", ".3f"),
                 cell("ttft_p50_ms", ",.0f"), cell("ttft_p99_ms", ",.0f"),
                 cell("ttft_p99_warm_ms", ",.0f"), errors]
            )  # fmt: skip
    many = " / ".join(map(str, counts))
    eviction = result.get("eviction") or {}
    rates = ", ".join(f"{w} at {RATES[w]:g}/s" for w in WORKLOADS)
    return [
        Table(
            f"{result['duration_s']:g} s of arrivals per run ({rates}) "
            f"through {many} replicas, {BACKENDS} simulated GPUs emptied before each run, fresh "
            f"ones each round; the means of {max(r['round'] for r in runs)} round(s); hit rate: "
            "the GPUs' own prefix-cache counters; warm: requests sent after the run's first "
            "quarter; " + harness.targets_met(result["targets"], "issue 17's"),
            ["workload", "events", f"hit rate, {many}", f"TTFT p50 ms, {many}",
             f"TTFT p99 ms, {many}", f"warm p99 ms, {many}", "errors"],
            rows,
        ),
        Table(
            f"one key's budget, {BUDGET:,} tokens a minute, asked ~7x by {BUDGET_CLIENTS} "
            "clients through 4 replicas, round by round; allowed: a minute's worth plus the "
            f"refill over the run. Redis killed halfway through a run below the budget: "
            f"{killed['answered']} answered, {killed['failed']} failed. POST /sim/evict until "
            f"a replica's index has it: {eviction.get('p50_ms', float('nan')):.1f} ms (p50), "
            f"{eviction.get('max_ms', float('nan')):.1f} at worst",
            ["Redis", "admitted / allowed", "admitted tokens", "answered", "refused", "failed"],
            [[redis, *(" / ".join(format(r[k], f) for r in mine)
                       for k, f in (("admitted_vs_allowed", ".2f"), ("admitted_tokens", ",d"),
                                    ("answered", "d"), ("refused", "d"))),
              sum(r["failed"] for r in mine)]
             for redis in dict.fromkeys(r["redis"] for r in budgets)
             if (mine := [r for r in budgets if r["redis"] == redis])],
        ),
        Table("issue 17's targets", ["check"], [[line] for line in result["targets"]]),
    ]  # fmt: skip


def plot(result: dict[str, Any], png: Path) -> None:
    runs = result["routing"]
    counts = sorted({r["replicas"] for r in runs})
    panels: dict[str, dict[str, list[float]]] = {}
    for key, what in (("hit_rate", "GPU prefix hit rate"), ("ttft_p99_ms", "TTFT p99 (ms)")):
        for workload in sorted({r["workload"] for r in runs}):
            panel = panels.setdefault(f"{workload}: {what}", {})
            for events, name in ((True, "events"), (False, "predicted")):
                means = [
                    mean_of(runs, key, workload=workload, replicas=n, events=events) for n in counts
                ]
                found = [value for value in means if value is not None]
                if len(found) == len(counts):  # --quick leaves events off out
                    panel[name] = found
    columns = len(panels) // 2
    plot_line_panels(panels, counts, "replicas", png, columns=columns, ticks_at_xs=True)


SCENARIO = Scenario(
    name="replicas",
    reproduces="issue 17",
    about="1, 2, 4 replicas behind a round robin, KV events on/off, budgets in Redis",
    reference=(
        "issue 17 (2026-11-24, main 5808e14, before KV events): 1 replica's hit rate 0.943, 2\n"
        "replicas 0.90-0.93, 4 replicas 0.87-0.88, p99 127 -> 158 -> 197 ms; N replicas granted\n"
        "N times a key's budget. Targets: 4 replicas' hit rate >= 0.98x one's with events,\n"
        ">= 0.95x without, p99 TTFT within 10% of one's; 1 replica with events >= without; with\n"
        "Redis 4 replicas admit <= 1.1x the budget; Redis killed mid-run: 0 failed requests."
    ),
    measure=measure,
    tables=tables,
    plot=plot,
)
