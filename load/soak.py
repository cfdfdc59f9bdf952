"""`python -m load soak --minutes N`: a mixed soak of `sluice serve` in front of two
simulated backends, all separate processes, with every kind of traffic that has broken a
proxy before, at once:

- steady open-loop traffic (rag, hot, chat and unique prompts, half of it streaming) at
  `--rate`, or at `--load` times what the two simulated GPUs answer of it when kept full
  (measured first, straight to them); a few long streams always in flight;
- conversations of 1,500-4,000 short messages, back to back;
- every 30 s a burst of 20 unique ~4k-token prompts;
- every 2.5 min a burst of 1,000 new connections, each streaming;
- every 2 s one malformed body (deep JSON nesting, megabyte garbage, a 12 MB over-long
  prompt, a body over the size limit, wrong types, ...);
- every 3 min one backend SIGKILLed mid-stream and restarted 20 s later on its port.

Two API keys (bearer tokens: without --api-keys each is a tenant of its own): `heavy` sends
HEAVY_X times `light`'s share of the steady traffic, the bursts and the connection bursts;
`light` the rest of the steady traffic, the long streams and the conversations. Past the
GPUs' capacity Sluice holds requests and sheds some with 429 and Retry-After: an answer, not
a loss (issue 32: "nothing lost"). `--sim-arg` passes flags to the simulated backends (a
small `--max-num-seqs` makes a capacity the machine's CPUs can offer twice over). `--door
epp` sends it all through a real Envoy asking Sluice as its endpoint picker (load/doors.py);
`--fleet pd` serves it disaggregated, two prefill and two decode engines, a prefill engine
the one killed; `--fleet dns` finds two engines through a real dnsmasq (`--discover-dns`)
and rolls one over every 3 min instead of the kill, drained before it stops, no window
excused (load/soak_rollout.py).

`/health` is polled every 5 ms. Every minute a line: requests, errors by kind (expected
ones, 429s with Retry-After, 4xx for bad input, 502/503 while a backend was down, fast 503s
with Retry-After shed over `--max-connections`, apart from Sluice's own faults), each key's
200 / 429 / expected / lost, the worst /health latency, stalls by cause from `/metrics` and
the proxy's RSS. A proxy that dies is counted, its log kept, and restarted on its port. The
verdict: crashes, requests lost to Sluice itself, RSS growth besides the tokenizer caches
(bounded by flags, they fill for minutes) from the end of minute 1 to the end (targets: 0,
0, <= 10%).
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial

import trio

from app.cli import command
from app.sim.settings import SimSettings
from load import drive, processes
from load.client import FAILURES, Pool, Prepared, call, encode
from load.doors import open_door
from load.drive import Record, send
from load.envoy_stack import epp_address
from load.harness import label_values, metric, parse_metrics
from load.processes import Stack
from load.soak_inputs import BadInput, catalog
from load.soak_report import (
    EXPECTED_WHEN_DOWN,
    EXPECTED_WHEN_DOWN_THROUGH_ENVOY,
    Minute,
    Windows,
    excuse,
    print_minute,
    within,
)
from load.soak_rollout import Rollout
from load.workloads import Request, Workload, completion, workload

DOWN_GRACE_S = 10.0  # after a restart: health check interval (3 s) + breaker cooldown slack
STEADY_RATE = 8.0
SIM_FLAGS = ("--max-num-seqs", "256")  # before --sim-arg's: theirs win
KEYS = {"heavy": "sk-soak-heavy", "light": "sk-soak-light"}
HEAVY_X = 10  # the heavy key's share of the steady traffic over the light key's
SHARES = {"heavy": HEAVY_X / (HEAVY_X + 1), "light": 1 / (HEAVY_X + 1)}
CAPACITY_WARM_S = 5.0  # not counted: the GPUs' prefix caches fill
CAPACITY_S = 20.0
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


# `--fleet pd`: the second is the prefill engine killed every KILL_EVERY_S.
PD_ROLES = ("prefill", "prefill", "decode", "decode")


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[key]}"}


def sim_settings(flags: list[str]) -> SimSettings:
    """The simulated backends' settings as `sluice sim-backend FLAGS` reads them (a bad
    --sim-arg stops the soak here, before anything starts)."""
    _, settings = command.parse(["sim-backend", *flags])
    assert isinstance(settings, SimSettings)
    return settings


class Soak:
    def __init__(
        self,
        minutes: float,
        seed: int,
        proxy_flags: list[str],
        sim_flags: list[str],
        rate: float,
        load: float | None,
        door: str = "proxy",
        fleet: str = "aggregated",
    ) -> None:
        self.door = door
        self.fleet = fleet
        self.proxy_flags = proxy_flags
        self.sim_flags = [*SIM_FLAGS, *sim_flags]
        self.seqs = sim_settings(self.sim_flags).max_num_seqs
        self.rate = rate  # the steady traffic's, both keys'; --load replaces it once measured
        self.load = load
        self.minutes = minutes
        self.rng = random.Random(seed)
        self.seed = seed
        self.stack = Stack()
        self.rollout = Rollout(self.stack, self.sim_flags, self.now)  # --fleet dns
        self.backends: list[str] = []
        self.roles: dict[str, list[str]] = {}  # each backend's role flags (--fleet pd)
        self.plain_backends: list[str] = []  # what the proxy gets as --backend
        self.backend_procs: dict[str, subprocess.Popen[bytes]] = {}
        self.proxy_url = ""  # Sluice's own: /metrics, /health
        self.door_url = ""  # where the clients send: Sluice's proxy, or Envoy asking Sluice
        self.proxy: subprocess.Popen[bytes] | None = None
        self.proxy_args: list[str] = []
        self.crashes: list[str] = []
        self.down: Windows = []  # [kill time, back-up time + grace]
        self.shedding: Windows = []  # connection-burst windows
        self.pools: dict[str, Pool] = {}  # each key's, to the proxy
        self.current = Minute()
        self.done: list[Minute] = []
        self.lost_examples: dict[str, str] = {}  # the first of each kind
        self.start = 0.0
        self.trio_start = 0.0
        self.stalls_before: dict[str, float] = {}

    # -- bookkeeping -------------------------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self.start

    def account(self, key: str, record: Record) -> None:
        """Count a valid request's outcome, and the key's: 200, 429 with Retry-After, another
        expected error, or lost to Sluice."""
        minute = self.current
        minute.requests += 1
        tally = minute.keys.setdefault(key, Counter())
        if record.ok:
            minute.ok += 1
            tally["200"] += 1
            return
        kind = record.error or "unknown"
        when_down = EXPECTED_WHEN_DOWN_THROUGH_ENVOY if self.door == "epp" else EXPECTED_WHEN_DOWN
        why = excuse(record, self.down, self.shedding, when_down)
        if why is not None:
            minute.expected[why] += 1
            tally["429" if kind == "http_429" else "expected"] += 1
            return
        tally["lost"] += 1
        lost = f"{record.tag}:{kind}"
        minute.sluice[lost] += 1
        self.lost_examples.setdefault(
            lost,
            f"t={record.start:.1f}s {key} {record.tag} -> {kind} after {record.e2e or 0:.2f}s"
            f" (retry-after {record.retry_after})",
        )

    def account_bad(
        self, bad: BadInput, status: int | None, error: str | None, sent_at: float, shed: bool
    ) -> None:
        """`shed`: a 503 that said when to come back; within a connection burst it is the
        door refusing a connection over --max-connections before reading it, as for any."""
        minute = self.current
        minute.requests += 1
        if status is not None and 400 <= status < 500:
            minute.expected[f"4xx_bad_input:{status}"] += 1
        elif status == 503 and shed and within(self.shedding, sent_at, self.now()):
            minute.expected["shed_503"] += 1
        else:
            key = f"bad_input:{bad.name}:{status or error}"
            minute.sluice[key] += 1
            self.lost_examples.setdefault(
                key, f"t={self.now():.1f}s {bad.name} -> {status or error}"
            )

    # -- processes ---------------------------------------------------------------------

    async def start_stack(self) -> None:
        """Two engines that do both; or with `--fleet pd`, two prefill engines and two
        decode engines (vLLM's flow), the second prefill engine the one killed; or with
        `--fleet dns`, two behind a DNS name, no --backend."""
        roles = {"pd": PD_ROLES, "dns": ()}.get(self.fleet, ("both", "both"))
        role_flags = await self.rollout.start() if self.fleet == "dns" else []
        self.backends += self.rollout.engines()
        for role in roles:
            as_role = [] if role == "both" else ["--role", role]
            url = await self.stack.sim(*self.sim_flags, *as_role)
            self.backends.append(url)
            self.roles[url] = as_role
            self.backend_procs[url] = self.stack.processes[-1]
            if role == "both":
                self.plain_backends.append(url)
            else:
                role_flags += [f"--{role}", url]
        flags = [*self.proxy_flags, *role_flags]
        door = await open_door(self.stack, self.door, self.plain_backends, *flags)
        self.door_url, self.proxy_url = door.url, door.sluice
        self.proxy = next(p for p in self.stack.processes if p.pid == door.pids[0])
        if self.fleet == "dns":
            await self.rollout.ready(self.proxy_url)
        port = self.proxy_url.rsplit(":", 1)[1]
        self.proxy_args = [*flags, "--port", port]
        if self.door == "epp":  # restarted, the picker is where Envoy looks for it
            picker = await epp_address(self.stack, self.proxy_url)
            self.proxy_args += ["--epp-port", picker.rsplit(":", 1)[1]]

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
            self.proxy_url = await self.stack.proxy(self.plain_backends, *self.proxy_args)
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
            await self.stack.sim(*self.sim_flags, *self.roles[url], "--port", port)
            self.backend_procs[url] = self.stack.processes[-1]
            window[1] = self.now() + DOWN_GRACE_S
            print(f"   t={self.now():.0f}s backend {url} restarted", flush=True)
            await trio.sleep(KILL_EVERY_S / 2 - KILL_DOWN_S)

    # -- traffic -----------------------------------------------------------------------

    def mixed(self, pool: Pool, name: str) -> Iterator[Prepared]:
        """The steady traffic's requests, half of them streaming. Every source `name` has
        the same system prompts (one seed: the GPUs' prefix caches serve them all) and
        questions of its own."""
        source = workload("mixed", self.seed)
        rng = source.rng = random.Random(f"{self.seed}-{name}")
        while True:
            for request in source.next():
                yield pool.prepare(request, rng.random() < 0.5)

    async def measure_capacity(self) -> float:
        """Requests/s the two simulated GPUs answer of the steady traffic when kept full: a
        closed loop of twice --max-num-seqs clients straight to each (what --load scales)."""
        records: list[Record] = []

        async def fill(url: str, name: str) -> None:
            async with Pool(url, timeout=REQUEST_TIMEOUT_S) as pool:
                run = await drive.closed_loop(
                    pool,
                    2 * self.seqs,
                    self.mixed(pool, name),
                    seconds=CAPACITY_WARM_S + CAPACITY_S,
                )
                records.extend(run.records)

        async with trio.open_nursery() as nursery:
            for number, url in enumerate(self.backends):
                nursery.start_soon(fill, url, f"capacity-{number}")
        ends = [r.start + (r.e2e or 0.0) for r in records if r.ok]
        counted = sum(CAPACITY_WARM_S <= end < CAPACITY_WARM_S + CAPACITY_S for end in ends)
        if not counted:
            raise RuntimeError(f"the simulated GPUs answered none of {len(records)} requests")
        return counted / CAPACITY_S

    async def one(self, key: str, request: Request, stream: bool) -> bool:
        pool = self.pools[key]
        record = await send(pool, pool.prepare(request, stream), self.start)
        self.account(key, record)
        return record.ok

    async def at_once(self, pool: Pool, key: str, requests: list[Request], stream: bool) -> None:
        plan = [(0.0, pool.prepare(request, stream)) for request in requests]
        await drive.open_loop(pool, plan, on_record=partial(self.account, key), start=self.start)

    async def steady(self, key: str) -> None:
        """Open-loop `mixed` traffic, the key's share of the steady rate (Poisson)."""
        pool = self.pools[key]
        rate = self.rate * SHARES[key]

        def plan() -> Iterator[tuple[float, Prepared]]:
            at = 0.0
            for item in self.mixed(pool, key):
                at += self.rng.expovariate(rate)
                yield at, item

        await drive.open_loop(pool, plan(), on_record=partial(self.account, key), start=self.start)

    async def long_streams(self) -> None:
        """Two 400-token streams (~2 s each on the default GPUs) always in flight: a backend
        kill breaks them."""
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 400,
        }
        request = Request("/v1/chat/completions", body, "long_stream")

        async def loop() -> None:
            while True:
                if not await self.one("light", request, True):
                    await trio.sleep(0.5)  # a client backs off; a dead proxy is not hammered

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(loop)

    async def long_conversations(self) -> None:
        source: Workload = workload("long", self.seed + 1)
        while True:
            for request in source.next():
                await self.one("light", request, False)
            await trio.sleep(1.0)  # think time

    async def bursts(self) -> None:
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
            await self.at_once(self.pools["heavy"], "heavy", prompts, False)

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
            heavy = bearer("heavy")
            async with Pool(self.door_url, heavy, timeout=REQUEST_TIMEOUT_S) as burst:
                await self.at_once(burst, "heavy", [request] * CONNECTION_BURST, True)
            window[1] = self.now()
            await trio.sleep(CONNECTION_BURST_EVERY_S)

    async def malformed(self) -> None:
        inputs = catalog()
        index = 0
        async with Pool(self.door_url, timeout=REQUEST_TIMEOUT_S) as pool:
            while True:
                await trio.sleep(MALFORMED_EVERY_S)
                bad = inputs[index % len(inputs)]
                index += 1
                headers = {"content-type": bad.content_type}
                request = encode(pool.netloc, "POST", bad.path, bad.body, headers)
                sent_at = self.now()
                try:
                    reply = await pool.send(request)
                    shed = "retry-after" in reply.headers
                    self.account_bad(bad, reply.status, None, sent_at, shed)
                except FAILURES as exc:
                    self.account_bad(bad, None, type(exc).__name__, sent_at, False)

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

    async def set_rate(self) -> None:
        if self.load is not None:
            capacity = await self.measure_capacity()
            self.rate = self.load * capacity
            print(
                f"the GPUs answer {capacity:.2f} req/s of the steady traffic (measured, "
                f"--max-num-seqs {self.seqs}); at {self.load:g}x:",
                end=" ",
            )
        shares = ", ".join(f"{key} {self.rate * share:.2f}/s" for key, share in SHARES.items())
        print(f"steady traffic {self.rate:.2f} req/s ({shares})", flush=True)

    async def run(self) -> None:
        async with self.stack:
            await self.start_stack()
            print(f"{self.door} {self.door_url}, backends {', '.join(self.backends)}", flush=True)
            await self.set_rate()
            self.start = time.perf_counter()
            self.trio_start = trio.current_time()
            # No limit on requests in flight: they wait at the proxy (held, or refused), not
            # in the client, so what Sluice holds and sheds is all the clients sent.
            async with (
                Pool(self.door_url, bearer("heavy"), timeout=REQUEST_TIMEOUT_S) as heavy,
                Pool(self.door_url, bearer("light"), timeout=REQUEST_TIMEOUT_S) as light,
                trio.open_nursery() as nursery,
            ):
                self.pools = {"heavy": heavy, "light": light}
                dns = self.fleet == "dns"
                faults = partial(self.rollout.roll, self.proxy_url) if dns else self.kill_backends
                nursery.start_soon(self.every_minute)
                for key in KEYS:
                    nursery.start_soon(self.steady, key)
                for job in (
                    self.long_streams,
                    self.long_conversations,
                    self.bursts,
                    self.connection_bursts,
                    self.malformed,
                    self.poll_health,
                    self.watch_proxy,
                    faults,
                ):
                    nursery.start_soon(job)
                await trio.sleep_until(self.trio_start + 60.0 * self.minutes + 0.5)
                nursery.cancel_scope.cancel()
