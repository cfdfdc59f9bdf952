"""`python -m load soak --minutes N`: a mixed soak of `sluice serve` in front of two
simulated backends, all separate processes, with every kind of traffic that has broken a
proxy before, at once:

- steady open-loop traffic (rag, hot, chat and unique prompts, half of it streaming) and a
  few long streams always in flight;
- conversations of 1,500-4,000 short messages, back to back;
- every 30 s a burst of 20 unique ~4k-token prompts;
- every 2.5 min a burst of 1,000 new connections, each streaming;
- every 2 s one malformed body (deep JSON nesting, megabyte garbage, a 12 MB over-long
  prompt, a body over the size limit, wrong types, ...);
- every 3 min one backend SIGKILLed mid-stream and restarted 20 s later on its port.

`/health` is polled every 5 ms. Every minute a line: requests, errors by kind (expected
ones, 4xx for bad input, 502/503 while a backend was down, fast 503s shed over
`--max-connections`, apart from Sluice's own faults), the worst /health latency, stalls by
cause from `/metrics` and the proxy's RSS. A proxy that dies is counted, its log kept, and
restarted on its port. The verdict: crashes, requests lost to Sluice itself, RSS growth from
the end of minute 1 to the end (targets: 0, 0, <= 10%).
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import time
from collections.abc import Iterator

import trio

from load import drive, processes
from load.client import FAILURES, Pool, Prepared, call, encode
from load.drive import Record, send
from load.harness import label_values, metric, parse_metrics
from load.processes import Stack
from load.soak_inputs import BadInput, catalog
from load.soak_report import Minute, print_minute, verdict
from load.workloads import Request, Workload, completion, workload

DOWN_GRACE_S = 10.0  # after a restart: health check interval (3 s) + breaker cooldown slack
STEADY_RATE = 8.0
BURST_EVERY_S = 30.0
CONNECTION_BURST_EVERY_S = 150.0
CONNECTION_BURST = 1000
MALFORMED_EVERY_S = 2.0
KILL_EVERY_S = 180.0
KILL_DOWN_S = 20.0
HEALTH_EVERY_S = 0.005
REQUEST_TIMEOUT_S = 120.0
STALLS = "sluice_event_loop_stalls_total"
CACHES = "sluice_tokenizer_cache"
EXPECTED_WHEN_DOWN = {"http_502", "http_503", "http_504", "stream_broken", "no_done"}


class Soak:
    def __init__(self, minutes: float, seed: int, proxy_flags: list[str]) -> None:
        self.proxy_flags = proxy_flags
        self.minutes = minutes
        self.rng = random.Random(seed)
        self.seed = seed
        self.stack = Stack()
        self.backends: list[str] = []
        self.backend_procs: dict[str, subprocess.Popen[bytes]] = {}
        self.proxy_url = ""
        self.proxy: subprocess.Popen[bytes] | None = None
        self.proxy_args: list[str] = []
        self.crashes: list[str] = []
        self.down: list[list[float]] = []  # [kill time, back-up time + grace]
        self.shedding: list[list[float]] = []  # connection-burst windows
        self.current = Minute()
        self.done: list[Minute] = []
        self.lost_examples: dict[str, str] = {}  # the first of each kind
        self.start = 0.0
        self.trio_start = 0.0
        self.stalls_before: dict[str, float] = {}

    # -- bookkeeping -------------------------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self.start

    def _within(self, windows: list[list[float]], start: float, end: float) -> bool:
        return any(start <= w[1] and end >= w[0] for w in windows)

    def account(self, record: Record) -> None:
        """Count a valid request's outcome as ok, expected, or Sluice's fault."""
        minute = self.current
        minute.requests += 1
        if record.ok:
            minute.ok += 1
            return
        kind = record.error or "unknown"
        end = record.start + (record.e2e or 0.0)
        if kind in EXPECTED_WHEN_DOWN and self._within(self.down, record.start, end):
            minute.expected[f"backend_down:{kind}"] += 1
        elif kind == "http_503" and self._within(self.shedding, record.start, end):
            minute.expected["shed_503"] += 1
        else:
            key = f"{record.tag}:{kind}"
            minute.sluice[key] += 1
            self.lost_examples.setdefault(
                key, f"t={record.start:.1f}s {record.tag} -> {kind} after {record.e2e or 0:.2f}s"
            )

    def account_bad(self, bad: BadInput, status: int | None, error: str | None) -> None:
        minute = self.current
        minute.requests += 1
        if status is not None and 400 <= status < 500:
            minute.expected[f"4xx_bad_input:{status}"] += 1
        else:
            key = f"bad_input:{bad.name}:{status or error}"
            minute.sluice[key] += 1
            self.lost_examples.setdefault(
                key, f"t={self.now():.1f}s {bad.name} -> {status or error}"
            )

    # -- processes ---------------------------------------------------------------------

    async def start_stack(self) -> None:
        for _ in range(2):
            url = await self.stack.sim("--max-num-seqs", "256")
            self.backends.append(url)
            self.backend_procs[url] = self.stack.processes[-1]
        self.proxy_url = await self.stack.proxy(self.backends, *self.proxy_flags)
        self.proxy = self.stack.processes[-1]
        port = self.proxy_url.rsplit(":", 1)[1]
        self.proxy_args = [*self.proxy_flags, "--port", port]

    async def watch_proxy(self) -> None:
        """A dead proxy is a crash: keep its log, restart it on its port."""
        while True:
            await trio.sleep(0.5)
            assert self.proxy is not None
            code = self.proxy.poll()
            if code is None:
                continue
            log = processes.log_path(self.proxy)
            kept = log.with_name(f"crash-{len(self.crashes) + 1}-{log.name}")
            log.replace(kept)
            self.crashes.append(f"t={self.now():.0f}s exit {code}, log {kept}")
            print(f"!! proxy died (exit {code}) at t={self.now():.0f}s; log in {kept}", flush=True)
            self.stack.forget(self.proxy)
            self.proxy_url = await self.stack.proxy(self.backends, *self.proxy_args)
            self.proxy = self.stack.processes[-1]

    async def kill_backends(self) -> None:
        """Every KILL_EVERY_S, SIGKILL the second backend mid-stream; restart it later."""
        url = self.backends[1]
        port = url.rsplit(":", 1)[1]
        while True:
            await trio.sleep(KILL_EVERY_S / 2)
            window = [self.now(), float("inf")]
            self.down.append(window)
            victim = self.backend_procs[url]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            self.stack.forget(victim)
            print(f"   t={self.now():.0f}s backend {url} killed", flush=True)
            await trio.sleep(KILL_DOWN_S)
            await self.stack.sim("--port", port, "--max-num-seqs", "256")
            self.backend_procs[url] = self.stack.processes[-1]
            window[1] = self.now() + DOWN_GRACE_S
            print(f"   t={self.now():.0f}s backend {url} restarted", flush=True)
            await trio.sleep(KILL_EVERY_S / 2 - KILL_DOWN_S)

    # -- traffic -----------------------------------------------------------------------

    async def one(self, pool: Pool, request: Request, stream: bool) -> bool:
        record = await send(pool, pool.prepare(request, stream), self.start)
        self.account(record)
        return record.ok

    async def at_once(self, pool: Pool, requests: list[Request], stream: bool) -> None:
        plan = [(0.0, pool.prepare(request, stream)) for request in requests]
        await drive.open_loop(pool, plan, on_record=self.account, start=self.start)

    async def steady(self, pool: Pool) -> None:
        """Open-loop `mixed` traffic at STEADY_RATE (Poisson), half of it streaming."""
        source = workload("mixed", self.seed)

        def plan() -> Iterator[tuple[float, Prepared]]:
            at = 0.0
            while True:
                at += self.rng.expovariate(STEADY_RATE)
                for request in source.next():
                    yield at, pool.prepare(request, self.rng.random() < 0.5)

        await drive.open_loop(pool, plan(), on_record=self.account, start=self.start)

    async def long_streams(self, pool: Pool) -> None:
        """Two 400-token streams (~2 s each) always in flight: a backend kill breaks them."""
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 400,
        }
        request = Request("/v1/chat/completions", body, "long_stream")

        async def loop() -> None:
            while True:
                if not await self.one(pool, request, True):
                    await trio.sleep(0.5)  # a client backs off; a dead proxy is not hammered

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(loop)

    async def long_conversations(self, pool: Pool) -> None:
        source: Workload = workload("long", self.seed + 1)
        while True:
            for request in source.next():
                await self.one(pool, request, False)
            await trio.sleep(1.0)  # think time

    async def bursts(self, pool: Pool) -> None:
        source = workload("unique", self.seed + 2)
        while True:
            await trio.sleep(BURST_EVERY_S)
            prompts = [
                completion(
                    source.corpus.text(self.rng, 4000) + f" [{self.rng.getrandbits(48):x}]",
                    1,
                    "large",
                )
                for _ in range(20)
            ]
            await self.at_once(pool, prompts, False)

    async def connection_bursts(self) -> None:
        """1,000 new connections at once, each streaming a short answer."""
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": "Count to four."}],
            "max_tokens": 4,
        }
        request = Request("/v1/chat/completions", body, "conn_burst")
        await trio.sleep(45.0)
        while True:
            window = [self.now(), float("inf")]
            self.shedding.append(window)
            async with Pool(self.proxy_url, timeout=REQUEST_TIMEOUT_S) as burst:
                await self.at_once(burst, [request] * CONNECTION_BURST, True)
            window[1] = self.now()
            await trio.sleep(CONNECTION_BURST_EVERY_S)

    async def malformed(self) -> None:
        inputs = catalog()
        index = 0
        async with Pool(self.proxy_url, timeout=REQUEST_TIMEOUT_S) as pool:
            while True:
                await trio.sleep(MALFORMED_EVERY_S)
                bad = inputs[index % len(inputs)]
                index += 1
                headers = {"content-type": bad.content_type}
                request = encode(pool.netloc, "POST", bad.path, bad.body, headers)
                try:
                    reply = await pool.send(request)
                    self.account_bad(bad, reply.status, None)
                except FAILURES as exc:
                    self.account_bad(bad, None, type(exc).__name__)

    async def poll_health(self) -> None:
        async with Pool(self.proxy_url, timeout=30) as pool:
            while True:
                sent = time.perf_counter()
                try:
                    await pool.call("GET", "/health")
                except FAILURES:
                    self.current.health_failures += 1
                    await trio.sleep(0.1)
                    continue
                elapsed = time.perf_counter() - sent
                if elapsed > self.current.health_worst_s:
                    self.current.health_worst_s = elapsed
                    self.current.health_worst_at = sent - self.start
                await trio.sleep(HEALTH_EVERY_S)

    # -- per minute --------------------------------------------------------------------

    async def scrape(self) -> tuple[dict[str, float], float | None]:
        """Stalls by cause, and the tokenizer caches' bytes."""
        try:
            samples = parse_metrics((await call(self.proxy_url + "/metrics")).text)
        except FAILURES:
            return {}, None
        caches = [metric(samples, f"{CACHES}_{level}_memory_bytes") for level in ("l0", "l1")]
        known = [c for c in caches if c is not None]
        return label_values(samples, STALLS, "cause"), sum(known) if known else None

    async def every_minute(self) -> None:
        self.stalls_before, _ = await self.scrape()
        number = 0
        while True:
            number += 1
            await trio.sleep_until(self.trio_start + 60.0 * number)
            minute, self.current = self.current, Minute()
            now, minute.cache_bytes = await self.scrape()
            minute.stalls = {k: v - self.stalls_before.get(k, 0.0) for k, v in now.items()}
            self.stalls_before = now
            assert self.proxy is not None
            minute.pid = self.proxy.pid
            minute.rss_bytes = (
                processes.rss_bytes(self.proxy.pid) if self.proxy.poll() is None else 0
            )
            self.done.append(minute)
            print_minute(number, minute)

    async def run(self) -> None:
        async with self.stack:
            await self.start_stack()
            print(f"proxy {self.proxy_url}, backends {', '.join(self.backends)}", flush=True)
            self.start = time.perf_counter()
            self.trio_start = trio.current_time()
            async with (
                Pool(self.proxy_url, limit=256, timeout=REQUEST_TIMEOUT_S) as pool,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(self.every_minute)
                for task in (self.steady, self.long_streams, self.long_conversations, self.bursts):
                    nursery.start_soon(task, pool)
                for job in (
                    self.connection_bursts,
                    self.malformed,
                    self.poll_health,
                    self.watch_proxy,
                    self.kill_backends,
                ):
                    nursery.start_soon(job)
                await trio.sleep_until(self.trio_start + 60.0 * self.minutes + 0.5)
                nursery.cancel_scope.cancel()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--proxy-arg", action="append", default=[], help="extra flag for `sluice serve`"
    )


def main(args: argparse.Namespace) -> None:
    if args.minutes < 1:
        raise SystemExit("soak: --minutes must be at least 1")
    soak = Soak(args.minutes, args.seed, args.proxy_arg)
    trio.run(soak.run)
    raise SystemExit(0 if verdict(soak.done, soak.crashes, soak.lost_examples) else 1)
