"""`python -m load bench replicas`: Sluice replicas routing as one (issue 17).

Four simulated GPUs (load/routing.py's profile) publish their KV events; 1, 2 and 4 Sluice
replicas (separate `sluice serve` processes) sit behind a round robin of TCP connections (what
a Kubernetes Service does), with `--kv-events` for every GPU or without; the routing
benchmark's seeded workloads (rag, chat, hot: load/routing_workloads.py) go through the round
robin. Between runs the GPUs' caches are emptied (`POST /sim/evict`), and the prefix hit rate
is the GPUs' own counters' (`vllm:prefix_cache_hits / queries`) over the run.

Budgets: 4 replicas with `--redis-url` (a redis-server of our own) and one API key's
`--tokens-per-minute`; clients ask for about three times the budget; admitted tokens (usage of
the answered requests) against what the budget allows over the run's length (one minute's
worth plus the refill), beside the same 4 replicas without Redis. Then Redis is killed halfway
through a run below the budget: every request must still be answered.

    python -m load bench replicas [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from collections.abc import Sequence
from itertools import count
from typing import Any

import httpx
import trio

from load.bench import common
from load.processes import free_port, start_process, stop_all
from load.routing import SIM_PROFILE, drive
from load.stats import percentile

BACKENDS = 4
REPLICAS = (1, 2, 4)
WORKLOADS = ("rag", "chat", "hot")
BUDGET = 60_000  # tokens a minute for the one key
BUDGET_CLIENTS = 6
LEAN = ("--render-workers", "1", "--tokenize-threads", "1", "--log-level", "warning")


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


async def start_sims(procs: list[subprocess.Popen[bytes]]) -> list[tuple[str, str]]:
    """(URL, KV events endpoint) of each simulated GPU."""
    sims = []
    for seed in range(BACKENDS):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        args = ["sim-backend", "--port", "0", "--seed", str(seed), *SIM_PROFILE]
        url = await start_process([*args, "--kv-events-endpoint", endpoint], "Simulated", procs)
        sims.append((url, endpoint))
    return sims


async def start_replicas(
    procs: list[subprocess.Popen[bytes]],
    sims: list[tuple[str, str]],
    replicas: int,
    events: bool,
    extra: Sequence[str] = (),
) -> list[str]:
    flags = ["serve", "--port", "0", "--dashboard-port", "0", "--policy", "cache_aware", *LEAN]
    for url, endpoint in sims:
        flags += ["--backend", url]
        if events:
            flags += ["--kv-events", f"{url}={endpoint}"]
    urls = []
    for _ in range(replicas):
        urls.append(await start_process([*flags, *extra], "Sluice proxy", procs))
    for url in urls:
        await common.wait_healthy(url)
    return urls


async def gpu_counters(
    client: httpx.AsyncClient, sims: list[tuple[str, str]]
) -> tuple[float, float]:
    hits = queries = 0.0
    for url, _ in sims:
        samples = common.parse_metrics((await client.get(url + "/metrics")).text)
        hits += common.metric(samples, "vllm:prefix_cache_hits_total") or 0.0
        queries += common.metric(samples, "vllm:prefix_cache_queries_total") or 0.0
    return hits, queries


async def routing_run(
    sims: list[tuple[str, str]], replicas: int, events: bool, workload: str, duration: float
) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        for url, _ in sims:
            (await client.post(url + "/sim/evict")).raise_for_status()
        try:
            urls = await start_replicas(procs, sims, replicas, events)
            balancer = RoundRobin(urls)
            async with trio.open_nursery() as nursery:
                await nursery.start(balancer.run)
                before = await gpu_counters(client, sims)
                samples = await drive(balancer.url, workload, duration, seed=0)
                after = await gpu_counters(client, sims)
                nursery.cancel_scope.cancel()
        finally:
            stop_all(procs)
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
    }


async def closed_loop(url: str, duration: float, pace: float) -> dict[str, Any]:
    """BUDGET_CLIENTS clients with one key, each a request every `pace` seconds at most."""
    tallies = {"admitted_tokens": 0, "answered": 0, "refused": 0, "failed": 0}
    words = "budget " * 700  # ~700 prompt tokens (the simulated GPU counts words)
    body = {"model": "m", "messages": [{"role": "user", "content": words}], "max_tokens": 16}
    headers = {"authorization": "Bearer one-key"}

    async def client_loop() -> None:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            deadline = trio.current_time() + duration
            while trio.current_time() < deadline:
                started = trio.current_time()
                try:
                    response = await http.post(
                        url + "/v1/chat/completions", json=body, headers=headers
                    )
                except httpx.HTTPError:
                    tallies["failed"] += 1
                else:
                    if response.status_code == 200:
                        usage = response.json()["usage"]
                        tallies["answered"] += 1
                        tallies["admitted_tokens"] += usage["prompt_tokens"]
                        tallies["admitted_tokens"] += usage["completion_tokens"]
                    elif response.status_code == 429:
                        tallies["refused"] += 1
                    else:
                        tallies["failed"] += 1
                await trio.sleep_until(started + pace)

    async with trio.open_nursery() as nursery:
        for _ in range(BUDGET_CLIENTS):
            nursery.start_soon(client_loop)
    return tallies


class Redis:
    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    async def start(self) -> str:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with trio.fail_after(10):
            while True:
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", self.port)
                    await stream.aclose()
                    return f"redis://127.0.0.1:{self.port}/0"
                except OSError:
                    await trio.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


async def budget_run(
    sims: list[tuple[str, str]], redis_url: str | None, duration: float, pace: float
) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    extra = ["--tokens-per-minute", str(BUDGET)]
    if redis_url:
        extra += ["--redis-url", redis_url, "--budget-sync-interval", "0.2"]
    try:
        urls = await start_replicas(procs, sims, 4, events=True, extra=extra)
        balancer = RoundRobin(urls)
        async with trio.open_nursery() as nursery:
            await nursery.start(balancer.run)
            started = time.monotonic()
            tallies = await closed_loop(balancer.url, duration, pace)
            elapsed = time.monotonic() - started
            nursery.cancel_scope.cancel()
    finally:
        stop_all(procs)
    allowed = BUDGET * (1 + elapsed / 60.0)
    return {
        "redis": redis_url is not None,
        "seconds": elapsed,
        "budget_per_minute": BUDGET,
        "allowed_tokens": allowed,
        **tallies,
        "admitted_vs_allowed": tallies["admitted_tokens"] / allowed,
    }


async def redis_killed_run(sims: list[tuple[str, str]], duration: float) -> dict[str, Any]:
    """Below the budget, Redis killed halfway: every request answered (no 5xx, no error)."""
    redis = Redis()
    url = await redis.start()
    procs: list[subprocess.Popen[bytes]] = []
    extra = ["--tokens-per-minute", str(BUDGET * 10), "--redis-url", url]
    try:
        urls = await start_replicas(procs, sims, 4, events=True, extra=extra)
        balancer = RoundRobin(urls)
        async with trio.open_nursery() as nursery:
            await nursery.start(balancer.run)

            async def kill_halfway() -> None:
                await trio.sleep(duration / 2)
                redis.kill()

            nursery.start_soon(kill_halfway)
            tallies = await closed_loop(balancer.url, duration, pace=0.5)
            nursery.cancel_scope.cancel()
    finally:
        stop_all(procs)
        redis.kill()
    return {"redis_killed_at_s": duration / 2, **tallies}


def plot(blob: dict[str, Any], png: Any) -> None:
    from load.plots import plt

    runs = blob["routing"]
    workloads = sorted({r["workload"] for r in runs})
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7), squeeze=False)
    for column, workload in enumerate(workloads):
        for events, style in ((True, "-o"), (False, "--s")):
            picked = sorted(
                (r for r in runs if r["workload"] == workload and r["events"] == events),
                key=lambda r: r["replicas"],
            )
            xs = [r["replicas"] for r in picked]
            label = "events" if events else "predicted"
            axes[0][column].plot(xs, [r["hit_rate"] for r in picked], style, label=label)
            axes[1][column].plot(xs, [r["ttft_p99_ms"] for r in picked], style, label=label)
        axes[0][column].set(title=f"{workload}: GPU prefix hit rate", xticks=list(REPLICAS))
        axes[1][column].set(title=f"{workload}: TTFT p99 (ms)", xlabel="replicas")
        axes[1][column].set_xticks(list(REPLICAS))
        axes[0][column].legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def targets(blob: dict[str, Any]) -> list[str]:
    lines = []

    def check(label: str, ok: bool) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'} {label}")

    runs = {(r["workload"], r["replicas"], r["events"]): r for r in blob["routing"]}
    for workload in sorted({r["workload"] for r in blob["routing"]}):
        for events, ratio in ((True, 0.98), (False, 0.95)):
            one, four = runs.get((workload, 1, events)), runs.get((workload, 4, events))
            if one and four:
                got = four["hit_rate"] / one["hit_rate"] if one["hit_rate"] else 0.0
                name = "events" if events else "no events"
                check(
                    f"{workload}, {name}: 4 replicas' hit rate {got:.3f}x one's >= {ratio}",
                    got >= ratio,
                )
                p99 = four["ttft_p99_ms"] / one["ttft_p99_ms"]
                check(
                    f"{workload}, {name}: 4 replicas' p99 TTFT {p99:.2f}x one's <= 1.10",
                    p99 <= 1.10,
                )
        on, off = runs.get((workload, 1, True)), runs.get((workload, 1, False))
        if on and off:
            with_, without = on["hit_rate"], off["hit_rate"]
            check(
                f"{workload}: 1 replica with events {with_:.3f} >= without {without:.3f}",
                with_ >= without,
            )
    for run in blob["budgets"]:
        if run["redis"]:
            ratio = run["admitted_vs_allowed"]
            check(f"4 replicas with Redis admit {ratio:.3f}x the budget <= 1.1", ratio <= 1.1)
    killed = blob.get("redis_killed")
    if killed:
        check(
            f"Redis killed mid-run: {killed['failed']} failed requests == 0", killed["failed"] == 0
        )
    return lines


async def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    duration = 6.0 if quick else 20.0
    workloads = ("rag",) if quick else WORKLOADS
    replica_counts = (1, 4) if quick else REPLICAS
    event_modes = (True,) if quick else (True, False)
    procs: list[subprocess.Popen[bytes]] = []
    blob: dict[str, Any] = {"routing": [], "budgets": []}
    try:
        sims = await start_sims(procs)
        for workload in workloads:
            for events in event_modes:
                order = replica_counts if events else tuple(reversed(replica_counts))
                for replicas in order:
                    result = await routing_run(sims, replicas, events, workload, duration)
                    print(
                        f"{workload:5} replicas={replicas} events={events!s:5} "
                        f"hit={result['hit_rate']:.3f} p50={result['ttft_p50_ms']:.0f} ms "
                        f"p99={result['ttft_p99_ms']:.0f} ms answered={result['answered']} "
                        f"errors={result['errors']}",
                        flush=True,
                    )
                    blob["routing"].append(result)
        budget_seconds = 8.0 if quick else 30.0
        # 6 clients, ~716 tokens each every 0.6 s: ~430k tokens a minute, 7x the budget.
        redis = Redis()
        try:
            url = await redis.start()
            for redis_url in (url, None) if not quick else (url,):
                result = await budget_run(sims, redis_url, budget_seconds, pace=0.6)
                print(
                    f"budget redis={result['redis']!s:5} admitted={result['admitted_tokens']} "
                    f"allowed={result['allowed_tokens']:.0f} "
                    f"({result['admitted_vs_allowed']:.3f}x) refused={result['refused']} "
                    f"failed={result['failed']}",
                    flush=True,
                )
                blob["budgets"].append(result)
        finally:
            redis.kill()
        killed = await redis_killed_run(sims, 8.0 if quick else 20.0)
        print(f"redis killed mid-run: {killed}", flush=True)
        blob["redis_killed"] = killed
    finally:
        stop_all(procs)
    return blob


def main(args: argparse.Namespace) -> None:
    blob = trio.run(run, args)
    lines = targets(blob)
    blob["targets"] = lines
    png = common.write("replicas", blob, args.out_dir)
    plot(blob, png)
    rows = [
        [
            r["workload"],
            r["replicas"],
            "on" if r["events"] else "off",
            r["hit_rate"],
            r["ttft_p50_ms"],
            r["ttft_p99_ms"],
            r["errors"],
        ]
        for r in blob["routing"]
    ]
    text = common.table(
        ["workload", "replicas", "events", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "errors"],
        rows,
        digits=3,
    )
    common.report("replicas", "issue 17's targets:\n" + "\n".join(lines), text, png)
