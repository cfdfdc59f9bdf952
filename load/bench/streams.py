"""`python -m load bench streams`: relaying a busy GPU's token streams (issue 15).

One simulated GPU that streams a token every 20 ms with no prefill (`--inter-token-latency
0.02`, no slow-down under load), and in front of it, taking turns: `direct` (the backend
itself), `sluice` (`sluice serve`) and, where installed, `smg`. For each number of concurrent
streams (default 50 and 200), closed-loop clients stream 200-token chats back to back for the
round's length while a probe in a process of its own (load/probe.py) sends `GET /health` every
10 ms on one keep-alive connection. Reported per target: tokens/s delivered, the proxy's CPU
per 1,000 tokens and as a share of a core (/proc), the inter-token gap the clients saw (p50,
p99; tokens that arrive in one read count as gaps of 0 after the first) and /health p99 and
worst while streaming.

The clients count `data: ` events per socket read on load/client.py's connections, framing
and all: a client library would spend more CPU than the proxies it measures on these two
cores.

What tracing costs on this workload is `bench tracing`'s (load/bench/tracing.py): two Sluices
streamed to at once, which these alternating rounds are too far apart to resolve.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from load import harness
from load.client import CHAT, ERRORS, ONE_TOKEN, Connection, encode
from load.harness import Bench, Scenario, Table
from load.plots import plot_bars
from load.processes import tree_cpu
from load.stats import percentile

TOKENS = 200
INTER_TOKEN_S = 0.02
PROBE_INTERVAL_S = 0.01
SIM_FLAGS = (
    "--prefill-overhead", "0",
    "--prefill-per-token", "0",
    "--inter-token-latency", str(INTER_TOKEN_S),
    "--time-factor-under-load", "1",
    "--max-num-seqs", "2048",
)  # fmt: skip
# Sluice as a user starts it: its admission reads the GPU's own metrics, and a GPU with room
# for 2,048 sequences is not saturated by 200 streams (issue 32's first target).
SLUICE_FLAGS: tuple[str, ...] = ()
BODY = {
    "model": "sim",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": TOKENS,
    "stream": True,
}
SEED_NOTE = (
    "issue 15 (2026-11-24, main 5808e14): 50 streams: direct 2,288 tokens/s, Sluice 2,280 at\n"
    "240 ms CPU per 1,000 tokens (0.55 of a core), SMG 2,296 at 44 ms (0.10), /health p99\n"
    "Sluice 24 ms vs SMG 3.6; 200 streams: direct 7,669, Sluice 4,486 at 192 ms (0.86),\n"
    "SMG 7,247 at 28 ms (0.20), /health p99 181 ms vs 5.7. Targets: CPU per 1,000 tokens\n"
    "<= 2x SMG's; at 200 streams tokens/s >= 0.95x direct and /health p99 <= 10 ms."
)


@dataclass
class Samples:
    """One target's figures over its rounds at one number of streams."""

    tokens: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    streams_done: int = 0
    errors: int = 0
    gaps: list[float] = field(default_factory=list)
    health: list[float] = field(default_factory=list)  # per round: p99
    health_worst: float = 0.0

    def report(self, measured: bool) -> dict[str, Any]:
        return {
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "cpu_ms_per_1000_tokens": self.cpu / max(self.tokens, 1) * 1e6 if measured else None,
            "cpu_share_of_core": self.cpu / self.seconds if measured and self.seconds else None,
            "gap_p50_ms": percentile(self.gaps, 50) * 1e3 if self.gaps else None,
            "gap_p99_ms": percentile(self.gaps, 99) * 1e3 if self.gaps else None,
            "health_p99_ms": max(self.health) * 1e3 if self.health else None,
            "health_worst_ms": self.health_worst * 1e3,
            "streams_done": self.streams_done,
            "errors": self.errors,
        }


class Window:
    """What the clients count between `start` and `stop`: the round's measured part."""

    def __init__(self) -> None:
        self.open = False
        self.tokens = 0
        self.streams_done = 0
        self.errors = 0
        self.gaps: list[float] = []


def chat_request(url: str) -> bytes:
    """The streamed chat every client sends to `url`, encoded once."""
    return encode(urlsplit(url).netloc, "POST", CHAT, json.dumps(BODY).encode())


async def stream_once(connection: Connection, request: bytes, window: Window) -> None:
    """One streamed chat to its end: `data: ` events counted, gaps between reads kept."""
    await connection.start(request)
    if connection.status != 200:
        raise ConnectionError(f"answered {connection.status}")
    last = time.perf_counter()
    carry = b""
    done = False
    while True:
        data = await connection.receive_raw()  # a closed connection raises ConnectionError
        events = (carry + data).count(b"data: ")
        if events:
            now = time.perf_counter()
            done = done or b"[DONE]" in data or b"[DONE]" in carry + data[:8]
            if window.open:
                window.gaps.append(now - last)
                window.gaps.extend([0.0] * (events - 1))
                window.tokens += events
            last = now
        carry = data[-5:]
        if done and (carry + data).endswith(b"0\r\n\r\n"):
            if window.open:
                window.tokens -= 1  # [DONE] is not a token
                window.streams_done += 1
            return


async def client_loop(url: str, request: bytes, window: Window, stop: trio.Event) -> None:
    connection = Connection(url)
    try:
        while not stop.is_set():
            try:
                await stream_once(connection, request, window)
            except ERRORS:
                window.errors += window.open
                await connection.close()
                await trio.sleep(0.05)
    finally:
        await connection.close()


async def one_round(
    url: str, pid: int | None, streams: int, warmup: float, seconds: float, samples: Samples
) -> float | None:
    """One round added to `samples`; its CPU ms per 1,000 tokens (None: not measured)."""
    request = chat_request(url)
    window = Window()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            nursery.start_soon(client_loop, url, request, window, stop)
        await trio.sleep(warmup)  # every stream started, their starts spread over a stream
        async with harness.health_probe(url, PROBE_INTERVAL_S) as probe:
            cpu0 = tree_cpu(pid) if pid else 0.0
            started = time.perf_counter()
            window.open = True
            await trio.sleep(seconds)
            window.open = False
            elapsed = time.perf_counter() - started
            cpu = (tree_cpu(pid) - cpu0) if pid else 0.0
        stop.set()
        nursery.cancel_scope.cancel()
    samples.tokens += window.tokens
    samples.seconds += elapsed
    samples.cpu += cpu
    samples.streams_done += window.streams_done
    samples.errors += window.errors
    samples.gaps += window.gaps
    samples.health.append(probe["p99_s"])
    samples.health_worst = max(samples.health_worst, probe["worst_s"])
    return cpu / max(window.tokens, 1) * 1e6 if pid else None


async def measure(bench: Bench) -> dict[str, Any]:
    """Every target at every number of streams."""
    counts = bench.args.streams or bench.pick([50], [50, 200])
    rounds, seconds = bench.rounds(1, 3), bench.pick(5.0, 10.0)
    warmup = TOKENS * INTER_TOKEN_S + 1.0
    targets = await start_targets(bench)
    by_count: dict[str, dict[str, Any]] = {}
    for count in counts:
        samples = {name: Samples() for name in targets}

        async def one(
            name: str, _: int, count: int = count, samples: dict[str, Samples] = samples
        ) -> dict[str, Any]:
            url, pid = targets[name]
            cpu = await one_round(url, pid, count, warmup, seconds, samples[name])
            return {"cpu_ms_per_1000_tokens": float("nan") if cpu is None else cpu}

        await bench.alternate(rounds, list(targets), one, f" {count} streams")
        by_count[str(count)] = {name: s.report(name != "direct") for name, s in samples.items()}
    return {
        "streams": by_count,
        "tokens_per_stream": TOKENS,
        "inter_token_s": INTER_TOKEN_S,
        "rounds": rounds,
        "seconds_per_round": seconds,
        "sluice_flags": list(SLUICE_FLAGS),
    }


async def start_targets(bench: Bench) -> dict[str, tuple[str, int | None]]:
    """{name: (URL, PID whose CPU is measured)} of every target that answers a chat."""
    sim = await bench.stack.sim(*SIM_FLAGS)
    targets: dict[str, tuple[str, int | None]] = {"direct": (sim, None)}
    for name, url in (await bench.proxies("sluice", sim, *SLUICE_FLAGS)).items():
        targets[name] = (url, bench.stack.pids[url])
    smg = None if bench.comparing else await bench.stack.smg([sim], "round_robin")
    if smg is not None:
        targets["smg"] = (smg, bench.stack.pids[smg])
    for name, (url, _) in list(targets.items()):
        if not await harness.answers(url, {}, ONE_TOKEN):
            print(f"{name} never answered a request; left out")
            del targets[name]
    return targets


def plot(result: dict[str, Any], png: Path) -> None:
    counts = list(result["streams"])
    groups = [f"{c} streams" for c in counts]
    names = [n for n in result["streams"][counts[0]] if n != "direct"]
    cpu = {n: [result["streams"][c][n]["cpu_ms_per_1000_tokens"] for c in counts] for n in names}
    plot_bars("Proxy CPU per 1,000 streamed tokens", groups, cpu, "ms", png)


def tables(result: dict[str, Any]) -> list[Table]:
    rows = []
    for count, targets in result["streams"].items():
        direct = targets["direct"]["tokens_per_s"] or 1.0
        smg = (targets.get("smg") or {}).get("cpu_ms_per_1000_tokens")
        for name, r in targets.items():
            cpu = r["cpu_ms_per_1000_tokens"]
            versus = cpu / smg if smg and cpu is not None and name != "smg" else None
            rows.append(
                [count, name, r["tokens_per_s"], r["tokens_per_s"] / direct, cpu, versus,
                 r["cpu_share_of_core"], r["gap_p50_ms"], r["gap_p99_ms"], r["health_p99_ms"],
                 r["health_worst_ms"], r["errors"]]
            )  # fmt: skip
    headers = [
        "streams", "target", "tokens/s", "x direct", "CPU ms/1k tok", "x SMG", "CPU share",
        "gap p50 ms", "gap p99 ms", "/health p99 ms", "/health max ms", "errors",
    ]  # fmt: skip
    title = (
        f"{result['tokens_per_stream']}-token streams at {result['inter_token_s'] * 1e3:g} ms a "
        f"token, {result['rounds']} alternating round(s) of {result['seconds_per_round']:g} s; "
        "x direct: tokens/s over direct's, x SMG: CPU per 1,000 tokens over SMG's (same run); "
        "/health p99: the worst round's"
    )
    return [Table(title, headers, rows, 2)]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--streams",
        type=harness.at_least_one,
        action="append",
        help="concurrent streams (repeatable; default 50 and 200, --quick 50)",
    )


SCENARIO = Scenario(
    name="streams",
    reproduces="issue 15",
    about="relaying N concurrent token streams: direct vs Sluice vs SMG",
    reference=SEED_NOTE,
    measure=measure,
    tables=tables,
    plot=plot,
    options=options,
)
