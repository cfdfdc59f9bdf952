"""The hardening targets (issue 7), each measured against real processes on 127.0.0.1.

    python -m load hardening long-chats  [--rounds 3]   # 3 clients x 1,500-4,000 messages
    python -m load hardening huge-prompt [--rounds 3]   # a 12 MB prompt over the window
    python -m load hardening streams     [--streams 1000]

One simulated backend (instant GPU, so only the proxy's own work shows) and proxies in front
of it, started as `sluice serve` processes. While the load runs, a probe in a process of its
own (load/probe.py) sends `GET /health` on one keep-alive connection every millisecond: its
worst latency is how long the proxy's event loop froze, as a client sees it.

- long-chats: each of 3 clients sends unique conversations of 1,500-4,000 short messages,
  one after the other; `inline` (the naive baseline: parse, render and encode on the loop)
  and `offload` (Sluice's default) alternate by round. Target: offload's worst /health
  <= 10 ms.
- huge-prompt: a 12 MB chat message against the simulated backend's 131,072-token window.
  Targets: refused (400 context_length_exceeded) within 0.5 s; worst /health <= 10 ms.
  (The naive baseline is not run: it encodes all 2.9 M tokens, 7-42 s here.)
- streams: that many streaming chat requests opened at once. Target: every one ends with
  `data: [DONE]`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import trio

from load.burst import english_like_text, parse_metrics
from load.processes import start_instant_sim, start_proxy, stop_all

TARGET_WORST_HEALTH_S = 0.010
TARGET_REFUSAL_S = 0.5
CLIENTS = 3
CHATS_PER_CLIENT = 4
HUGE_PROMPT_BYTES = 12_000_000
TIMEOUT_S = 120.0
PROBE_INTERVAL_S = 0.001


@dataclass
class Round:
    scenario: str
    mode: str
    wall_s: float
    health_worst_s: float
    health_p99_s: float
    probes: int
    detail: str
    stalls: dict[str, float]  # the proxy's own stall detector: stalls by cause in the round


STALLS = "sluice_event_loop_stalls_total{"


async def stalls_by_cause(client: httpx.AsyncClient, proxy_url: str) -> dict[str, float]:
    samples = parse_metrics((await client.get(proxy_url + "/metrics")).text)
    causes: dict[str, float] = {}
    for key, value in samples.items():
        if key.startswith(STALLS):
            cause = key.split('cause="', 1)[1].split('"', 1)[0] if 'cause="' in key else "?"
            causes[cause] = causes.get(cause, 0.0) + value
    return causes


def conversation(rng: random.Random) -> bytes:
    messages = [{"role": "system", "content": f"conversation {rng.getrandbits(64):016x}"}]
    for i in range(rng.randint(1500, 4000)):
        role = ("user", "assistant")[i % 2]
        messages.append({"role": role, "content": english_like_text(rng, rng.randint(20, 120))})
    return json.dumps({"model": "sim", "messages": messages, "max_tokens": 1}).encode()


async def under_probe(
    client: httpx.AsyncClient,
    proxy_url: str,
    scenario: str,
    mode: str,
    load: Callable[[], Awaitable[str]],
) -> Round:
    """Run `load` while a separate process probes /health; `load` returns a one-line detail
    for the table."""
    before = await stalls_by_cause(client, proxy_url)
    probe = await trio.lowlevel.open_process(
        [sys.executable, "-m", "load.probe", proxy_url, str(PROBE_INTERVAL_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert probe.stdin is not None and probe.stdout is not None
    try:
        with trio.fail_after(TIMEOUT_S):
            await read_line(probe.stdout)  # "ready"
            started = time.perf_counter()
            detail = await load()
            wall = time.perf_counter() - started
            await probe.stdin.send_all(b"stop\n")
            summary = json.loads(await read_line(probe.stdout))
    finally:
        probe.kill()
        await probe.wait()
    if summary["failures"]:
        detail += f"; {summary['failures']} /health probes failed"
    after = await stalls_by_cause(client, proxy_url)
    stalls = {cause: after[cause] - before.get(cause, 0.0) for cause in after}
    return Round(
        scenario,
        mode,
        wall,
        summary["worst_s"],
        summary["p99_s"],
        summary["probes"],
        detail,
        {cause: n for cause, n in stalls.items() if n},
    )


async def read_line(stream: trio.abc.ReceiveStream) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = await stream.receive_some(1)
        if not chunk:
            raise RuntimeError("the /health probe exited early")
        line += chunk
    return line


async def long_chats(client: httpx.AsyncClient, proxy_url: str, mode: str, seed: int) -> Round:
    rng = random.Random(seed)
    bodies = [[conversation(rng) for _ in range(CHATS_PER_CLIENT)] for _ in range(CLIENTS)]
    statuses: list[int] = []

    async def one_client(chats: list[bytes]) -> None:
        for body in chats:
            response = await client.post(
                proxy_url + "/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
            )
            statuses.append(response.status_code)

    async def load() -> str:
        async with trio.open_nursery() as nursery:
            for chats in bodies:
                nursery.start_soon(one_client, chats)
        ok = statuses.count(200)
        return f"{ok}/{len(statuses)} answered 200"

    return await under_probe(client, proxy_url, "long-chats", mode, load)


async def huge_prompt(client: httpx.AsyncClient, proxy_url: str, mode: str, seed: int) -> Round:
    rng = random.Random(seed)
    text = english_like_text(rng, HUGE_PROMPT_BYTES)
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": text}]}).encode()

    async def load() -> str:
        response = await client.post(
            proxy_url + "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        code = response.json().get("error", {}).get("code") if response.status_code != 200 else ""
        return f"{response.status_code} {code}"

    return await under_probe(client, proxy_url, "huge-prompt", mode, load)


async def streams(client: httpx.AsyncClient, proxy_url: str, mode: str, count: int) -> Round:
    finished: list[bool] = []

    async def one() -> None:
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": f"stream {len(finished)}"}],
            "stream": True,
            "max_tokens": 16,
        }
        ended = False
        try:
            async with client.stream(
                "POST", proxy_url + "/v1/chat/completions", json=body
            ) as response:
                async for line in response.aiter_lines():
                    ended = ended or line == "data: [DONE]"
        except httpx.HTTPError:
            ended = False
        finished.append(ended)

    async def load() -> str:
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
        return f"{finished.count(True)}/{count} ended with [DONE]"

    return await under_probe(client, proxy_url, "streams", mode, load)


async def measure(args: argparse.Namespace) -> list[Round]:
    processes: list[subprocess.Popen[bytes]] = []
    modes = ("inline", "offload") if args.scenario == "long-chats" else ("offload",)
    limits = httpx.Limits(max_connections=args.streams + 16, max_keepalive_connections=64)
    try:
        sim_url = await start_instant_sim(processes)
        urls = {
            mode: await start_proxy(processes, sim_url, "--tokenize-mode", mode) for mode in modes
        }
        rounds: list[Round] = []
        async with httpx.AsyncClient(limits=limits, timeout=TIMEOUT_S, trust_env=False) as client:
            for mode in modes:  # wait for health, warm the connections and the workers
                with trio.fail_after(30):
                    while (await client.get(urls[mode] + "/health")).status_code != 200:
                        await trio.sleep(0.1)
            for round_number in range(args.rounds):
                for mode in modes:
                    url = urls[mode]
                    if args.scenario == "long-chats":
                        rounds.append(await long_chats(client, url, mode, round_number))
                    elif args.scenario == "huge-prompt":
                        rounds.append(await huge_prompt(client, url, mode, round_number))
                    else:
                        rounds.append(await streams(client, url, mode, args.streams))
    finally:
        stop_all(processes)
    return rounds


def report(scenario: str, rounds: list[Round]) -> None:
    print(f"\n{scenario}: worst GET /health while loaded (probe every 1 ms)")
    print("round mode     wall s  /health worst ms  p99 ms  probes  stalls by cause  result")
    for i, r in enumerate(rounds):
        stalls = ",".join(f"{cause}:{n:g}" for cause, n in sorted(r.stalls.items())) or "none"
        print(
            f"{i // len({x.mode for x in rounds}) + 1:5} {r.mode:8} {r.wall_s:6.2f} "
            f"{r.health_worst_s * 1e3:17.1f} {r.health_p99_s * 1e3:7.1f} {r.probes:7}  "
            f"{stalls:15}  {r.detail}"
        )
    offload = [r for r in rounds if r.mode == "offload"]
    worst = max(r.health_worst_s for r in offload)
    verdict = "met" if worst <= TARGET_WORST_HEALTH_S else "MISSED"
    print(f"offload worst /health {worst * 1e3:.1f} ms (target <= 10 ms: {verdict})")
    inline = [r for r in rounds if r.mode == "inline"]
    if inline:
        ratio = max(r.health_worst_s for r in inline) / worst
        print(f"inline/offload worst /health: {ratio:.1f}x")
    if scenario == "huge-prompt":
        slowest = max(r.wall_s for r in offload)
        verdict = "met" if slowest <= TARGET_REFUSAL_S else "MISSED"
        median = statistics.median(r.wall_s for r in offload)
        print(
            f"refused in {median:.2f} s median, {slowest:.2f} s worst (target <= 0.5 s: {verdict})"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", choices=("long-chats", "huge-prompt", "streams"))
    parser.add_argument("--rounds", type=int, default=3, help="rounds, modes alternating")
    parser.add_argument("--streams", type=int, default=1000, help="streams opened at once")


def main(args: argparse.Namespace) -> None:
    report(args.scenario, trio.run(measure, args))
