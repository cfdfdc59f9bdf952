"""The soak's `--fleet dns` (load/soak.py): engines found through a real DNS server, and a
rolling replacement where the other fleets SIGKILL a backend.

A dnsmasq (load/dnsmasq.py) serves one name whose A records are the engines: two simulated
engines on 127.0.0.2 and 127.0.0.3, one port. Sluice follows the name (`--discover-dns`,
`--discover-interval 1`) and has no `--backend`. Every ROLL_EVERY_S (the first half-way
through, as the kills), one rollout, each step printed with its time:

1. a new engine on the next loopback address (127.0.0.4, then .5, ...), same port;
2. its record added; wait until Sluice sends it a request (`sluice_backend_requests_total`
   or `sluice_backend_inflight_requests` for its URL);
3. the oldest engine's record removed; wait until Sluice takes it out of the pool
   (`sluice_discovery_changes_total{change="left"}` one up) and its drain ends
   (`sluice_backend_drains_total` one up: finished, or timed_out after --drain-timeout);
4. that engine stopped (SIGTERM).

A drain before the stop loses nothing, so the soak excuses no window around a rollout:
whatever fails meanwhile counts as lost. A wait that runs out is printed (`!!`) and the
rollout goes on: the requests it costs show in the verdict.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from load.client import FAILURES
from load.dnsmasq import Dnsmasq
from load.harness import label_values, scrape
from load.processes import LOG_DIR, Stack

NAME = "engines.soak.test"
FIRST_ENGINES = 2
ROLL_EVERY_S = 180.0
INTERVAL_S = 1.0  # --discover-interval
DRAIN_TIMEOUT_S = 30.0  # --drain-timeout
TRAFFIC_WAIT_S = 30.0  # a joined engine's first request: interval + health check, with room
LEAVE_WAIT_S = 10.0  # a removed record -> out of the pool: an interval, with room
POLL_S = 0.1
SCRAPE_WAIT_S = 10.0
HEALTHY = "sluice_backend_healthy"
REQUESTS = "sluice_backend_requests_total"
INFLIGHT = "sluice_backend_inflight_requests"
CHANGES = "sluice_discovery_changes_total"
DRAINS = "sluice_backend_drains_total"
ADDRESSES = 253  # 127.0.0.2 .. 127.0.0.254


@dataclass
class Records:
    """The A records behind NAME, oldest first, and the loopback addresses handed out: a new
    engine takes the next address no engine holds (127.0.0.2 upward, round after .254)."""

    serving: list[str] = field(default_factory=list)
    handed_out: int = 0

    def next_address(self) -> str:
        if len(self.serving) >= ADDRESSES:
            raise RuntimeError("every loopback address holds an engine")
        while True:
            address = f"127.0.0.{2 + self.handed_out % ADDRESSES}"
            self.handed_out += 1
            if address not in self.serving:
                return address

    def add(self, address: str) -> list[str]:
        """The records once `address` joins."""
        self.serving.append(address)
        return list(self.serving)

    def remove_oldest(self) -> tuple[str, list[str]]:
        """The oldest address, and the records without it."""
        oldest = self.serving.pop(0)
        return oldest, list(self.serving)


def traffic_to(samples: dict[str, float], url: str) -> float:
    """Requests Sluice forwarded to `url` so far, and those in flight there."""
    return label_values(samples, REQUESTS, "backend").get(url, 0.0) + label_values(
        samples, INFLIGHT, "backend"
    ).get(url, 0.0)


def left(samples: dict[str, float], source: str) -> float:
    """Engines `source` took out of the pool so far."""
    return samples.get(f'{CHANGES}{{change="left",source="{source}"}}', 0.0)


def drains(samples: dict[str, float]) -> dict[str, float]:
    """Drains ended so far, by outcome (finished, timed_out)."""
    return label_values(samples, DRAINS, "outcome")


class Rollout:
    """dnsmasq, the engines behind NAME, and the rollouts; `start` before Sluice, `ready`
    after it, `roll` while the soak runs. The Stack stops dnsmasq and the engines at the
    end."""

    def __init__(self, stack: Stack, sim_flags: Sequence[str], now: Callable[[], float]):
        self.stack = stack
        self.sim_flags = list(sim_flags)
        self.now = now  # seconds since the soak's start
        self.records = Records()
        self.urls: dict[str, str] = {}  # address -> engine URL
        self.port = ""
        self.dnsmasq: Dnsmasq | None = None

    @property
    def source(self) -> str:
        return f"dns:{NAME}:{self.port}"

    async def start(self) -> list[str]:
        """dnsmasq and the first engines; Sluice's flags to follow them."""
        LOG_DIR.mkdir(exist_ok=True)  # dnsmasq's hosts file and log stay with the others
        self.dnsmasq = Dnsmasq(Path(tempfile.mkdtemp(prefix="dnsmasq-", dir=LOG_DIR)))
        for _ in range(FIRST_ENGINES):
            await self.start_engine()
        self.dnsmasq.hosts = {NAME: tuple(self.records.serving)}
        await self.dnsmasq.start()
        assert self.dnsmasq.process is not None
        self.stack.processes.insert(0, self.dnsmasq.process)  # stopped last
        return [
            "--discover-dns", f"{NAME}:{self.port}",
            "--dns-server", self.dnsmasq.server,
            "--discover-interval", f"{INTERVAL_S:g}",
            "--drain-timeout", f"{DRAIN_TIMEOUT_S:g}",
        ]  # fmt: skip

    async def start_engine(self) -> str:
        """An engine on the next address (the first on a free port, the others on its port);
        its address, recorded as serving."""
        address = self.records.next_address()
        port = ["--port", self.port] if self.port else []
        url = await self.stack.sim(*self.sim_flags, "--host", address, *port)
        self.port = self.port or url.rsplit(":", 1)[1]
        self.urls[address] = url
        self.records.add(address)
        return address

    async def ready(self, proxy: str) -> None:
        """Back once Sluice found the first engines and takes them (the soak's traffic
        starts then: a request before is not a rollout's)."""
        first = self.engines()

        def healthy(samples: dict[str, float]) -> bool:
            health = label_values(samples, HEALTHY, "backend")
            return all(health.get(url) == 1 for url in first)

        if not await self.wait(proxy, healthy, TRAFFIC_WAIT_S):
            raise RuntimeError(f"Sluice did not find {', '.join(first)} through {self.source}")

    def engines(self) -> list[str]:
        return [self.urls[address] for address in self.records.serving]

    async def roll(self, proxy: str) -> None:
        """A rollout every ROLL_EVERY_S, the first half-way through the first period."""
        await trio.sleep(ROLL_EVERY_S / 2)
        while True:
            began = trio.current_time()
            await self.rollout(proxy)
            await trio.sleep_until(began + ROLL_EVERY_S)

    async def rollout(self, proxy: str) -> None:
        assert self.dnsmasq is not None
        began = self.now()
        self.say(f"rollout: starting an engine beside {', '.join(self.engines())}")
        address = await self.start_engine()
        new = self.urls[address]
        await self.dnsmasq.set_hosts({NAME: self.records.serving})
        self.say(f"{new} started, its record added")
        seen = await self.wait(proxy, lambda s: traffic_to(s, new) > 0, TRAFFIC_WAIT_S)
        self.say(f"{new} takes traffic" if seen else f"!! {new} took no request")
        before = await self.samples(proxy)
        oldest, remaining = self.records.remove_oldest()
        old = self.urls.pop(oldest)
        removed = self.now()
        await self.dnsmasq.set_hosts({NAME: remaining})
        self.say(f"{old}'s record removed")
        gone = await self.wait(
            proxy, lambda s: left(s, self.source) > left(before, self.source), LEAVE_WAIT_S
        )
        self.say(f"{old} out of the pool, draining" if gone else f"!! {old} still in the pool")
        ended = dict(drains(before))
        drained = await self.wait(
            proxy,
            lambda s: sum(drains(s).values()) > sum(ended.values()),
            DRAIN_TIMEOUT_S + LEAVE_WAIT_S,
        )
        outcome = ", ".join(
            f"{k} {v - ended.get(k, 0.0):g}"
            for k, v in drains(await self.samples(proxy)).items()
            if v > ended.get(k, 0.0)
        )
        self.say(
            f"{old} drained ({outcome}) {self.now() - removed:.1f} s after its record went"
            if drained
            else f"!! {old} not drained"
        )
        await self.stack.stop(old)
        self.say(f"{old} stopped (SIGTERM); rollout took {self.now() - began:.1f} s")

    def say(self, line: str) -> None:
        print(f"   t={self.now():.1f}s {line}", flush=True)

    async def samples(self, proxy: str) -> dict[str, float]:
        """Sluice's /metrics now, asked again for up to SCRAPE_WAIT_S while it does not
        answer (a restart, a connection burst); {} after that."""
        with trio.move_on_after(SCRAPE_WAIT_S):
            while True:
                try:
                    return await scrape(proxy)
                except (*FAILURES, RuntimeError):
                    await trio.sleep(POLL_S)
        return {}

    async def wait(
        self, proxy: str, done: Callable[[dict[str, float]], bool], limit: float
    ) -> bool:
        """Poll Sluice's /metrics until `done` holds (True) or `limit` s pass (False)."""
        with trio.move_on_after(limit):
            while not done(await self.samples(proxy)):
                await trio.sleep(POLL_S)
            return True
        return False
