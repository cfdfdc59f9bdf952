"""`python -m load bench overhead`: what a proxy costs, side by side on one simulated backend.

Targets: `direct` (the backend itself), `sluice` (`sluice serve`), and, where installed in
their own venvs, `smg` (`/tmp/venv-smg`, `smg launch`) and `litellm` (`/tmp/venv-litellm`,
the LiteLLM proxy). Two floors (load/floors.py) answer without any backend:
`floor-hypercorn`, the bare server Sluice runs on, and `floor-h11`, h11 on bare Trio streams;
their CPU per request is what the server alone costs. The backend answers instantly, so
what remains is HTTP and each proxy's own work. Non-streaming one-token chat requests.

1. Fixed open-loop rates: the targets take turns (rounds alternate) at each rate; added
   p50/p99 = the proxy's minus direct's in the same rounds; CPU per request from /proc
   (the proxy's process and its children).
2. Closed loop: 32 clients, requests per second.
3. Idle: CPU per second with no traffic.

Environment: SMG_BIN, LITELLM_BIN override where those live.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from load import arrivals, processes
from load.bench import common
from load.plots import plot_bars
from load.rawhttp import RawConnection
from load.stats import percentile

PATH = "/v1/chat/completions"
FLOORS = ("hypercorn", "h11")
BODY = {"model": "sim", "messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 1}
SMG_BIN = Path(os.environ.get("SMG_BIN", "/tmp/venv-smg/bin/smg"))
LITELLM_BIN = Path(os.environ.get("LITELLM_BIN", "/tmp/venv-litellm/bin/litellm"))
LITELLM_KEY = "sk-sluice-bench"
SEED_NOTE = (
    "issue 10 (2026-11-22, same method): added p50 at 25 req/s Sluice 1.7 ms, SMG 0.9, LiteLLM\n"
    "11.3 (it documents 2-12 ms p50); CPU/request Sluice 1.5-1.8 ms, SMG 0.6, LiteLLM 9.5;\n"
    "32 clients: Sluice 1,183 req/s, SMG 1,776, LiteLLM 103; idle CPU Sluice 17.5 ms/s, SMG 5,\n"
    "LiteLLM 2.5. Targets: Sluice <= 1.0 ms CPU/request, <= 1 ms added p50, idle <= 5 ms/s."
)


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (LiteLLM and SMG may fork)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += processes.cpu_seconds(current)
        except OSError:
            continue
        todo.extend(children.get(current, []))
    return total


async def start_targets(
    stack: common.Stack, sim: str, peers: list[str]
) -> dict[str, tuple[str, int | None, dict[str, str]]]:
    """{name: (base URL, pid to measure or None, headers)}; `peers`: the installed ones."""
    targets: dict[str, tuple[str, int | None, dict[str, str]]] = {"direct": (sim, None, {})}
    url = await stack.proxy(sim)
    targets["sluice"] = (url, stack.pids[url], {})
    for floor in FLOORS:
        url = f"http://127.0.0.1:{processes.free_port()}"
        argv = [sys.executable, "-m", "load.floors", floor, url.rsplit(":", 1)[1]]
        targets[f"floor-{floor}"] = (url, await stack.command(argv, url), {})
    if "smg" in peers:
        smg = await start_smg(stack, sim)
        if smg is not None:
            targets["smg"] = (*smg, {})
    if "litellm" in peers:
        port = processes.free_port()
        url = f"http://127.0.0.1:{port}"
        config = Path(tempfile.mkdtemp()) / "litellm.yaml"
        config.write_text(
            "model_list:\n  - model_name: sim\n    litellm_params:\n"
            f"      model: openai/sim\n      api_base: {sim}/v1\n      api_key: unused\n"
        )
        env = {
            "LITELLM_MASTER_KEY": LITELLM_KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
        }
        argv = [str(LITELLM_BIN), "--config", str(config), "--host", "127.0.0.1",
                "--port", str(port), "--num_workers", "1"]  # fmt: skip
        try:
            pid = await stack.command(argv, url, "/health/liveliness", env)
            targets["litellm"] = (url, pid, {"authorization": f"Bearer {LITELLM_KEY}"})
        except (RuntimeError, trio.TooSlowError) as exc:
            print(f"litellm did not start: {exc}")
    return targets


async def start_smg(stack: common.Stack, sim: str) -> tuple[str, int] | None:
    """SMG in front of `sim` (round robin): (URL, pid), or None if it did not start."""
    port = processes.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(SMG_BIN), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", sim, "--policy", "round_robin",
            "--prometheus-port", str(processes.free_port()), "--log-level", "warn"]  # fmt: skip
    try:
        return url, await stack.command(argv, url)
    except (RuntimeError, trio.TooSlowError) as exc:
        print(f"smg did not start: {exc}")
        return None


async def answers(url: str, headers: dict[str, str]) -> bool:
    """Wait (60 s at most) until `url` answers a chat request with 200 (SMG registers its
    worker late)."""
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        with trio.move_on_after(60):
            while True:
                try:
                    response = await client.post(
                        url + "/v1/chat/completions", json=BODY, headers=headers
                    )
                    if response.status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.5)
    return False


@dataclass
class Samples:
    """One target's latencies, errors and CPU seconds over the rounds at one rate."""

    lat: list[float] = field(default_factory=list)
    errors: int = 0
    cpu: float = 0.0

    def report(self, direct: list[float], proxy: bool) -> dict[str, float]:
        requests = max(len(self.lat) + self.errors, 1)
        return {
            "p50_ms": percentile(self.lat, 50) * 1e3,
            "p99_ms": percentile(self.lat, 99) * 1e3,
            "added_p50_ms": (percentile(self.lat, 50) - percentile(direct, 50)) * 1e3,
            "added_p99_ms": (percentile(self.lat, 99) - percentile(direct, 99)) * 1e3,
            "cpu_ms_per_request": self.cpu / requests * 1e3 if proxy else float("nan"),
            "errors": self.errors,
        }


class Pool:
    """Idle keep-alive connections to one target, reused as a client library would."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url = url
        self.request = RawConnection.request(url, PATH, json.dumps(BODY).encode(), headers)
        self.idle: list[RawConnection] = []

    async def send(self) -> int:
        """One request; a pooled connection the server closed meanwhile is retried once."""
        reused = bool(self.idle)
        connection = self.idle.pop() if reused else RawConnection(self.url)
        try:
            status = await connection.send(self.request)
        except (OSError, trio.BrokenResourceError):
            if not reused:
                raise
            connection = RawConnection(self.url)
            status = await connection.send(self.request)
        self.idle.append(connection)
        return status

    async def close(self) -> None:
        for connection in self.idle:
            await connection.close()


async def open_loop(pool: Pool, rate: float, seconds: float, seed: int) -> tuple[list[float], int]:
    latencies: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        sent = time.perf_counter()
        try:
            status = await pool.send()
        except (OSError, trio.BrokenResourceError):
            errors += 1
            return
        if status == 200:
            latencies.append(time.perf_counter() - sent)
        else:
            errors += 1

    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        for at in arrivals.schedule("poisson", rate, seconds, seed):
            await trio.sleep_until(t0 + at)
            nursery.start_soon(one)
    return latencies, errors


async def closed_loop(pool: Pool, clients: int, seconds: float) -> float:
    """`clients` workers, each on its own keep-alive connection, as closed-loop clients are."""
    done = 0
    deadline = trio.current_time() + seconds

    async def worker() -> None:
        nonlocal done
        connection = RawConnection(pool.url)
        try:
            while trio.current_time() < deadline:
                try:
                    status = await connection.send(pool.request)
                    done += status == 200  # not `done += await ...`: that reads `done` first
                except (OSError, trio.BrokenResourceError):
                    await trio.sleep(0.01)
        finally:
            await connection.close()

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(worker)
    return done / (time.perf_counter() - started)


async def measure(args: argparse.Namespace, peers: list[str]) -> dict[str, Any]:
    quick = args.quick
    rates = (25.0, 100.0) if quick else (25.0, 100.0, 200.0)
    rounds = args.rounds or (2 if quick else 4)
    seconds = 4.0 if quick else 8.0
    async with common.Stack() as stack:
        # The model is called "sim" on the backend too: SMG routes by the backend's model id.
        sim = await stack.sim("--model", "sim", instant=True)
        targets = await start_targets(stack, sim, peers)
        for name, (url, _, headers) in list(targets.items()):
            if not await answers(url, headers):
                print(f"{name} never answered a request; left out")
                del targets[name]
        names = list(targets)
        fixed: dict[str, dict[str, dict[str, Any]]] = {}
        pools = {name: Pool(url, headers) for name, (url, _, headers) in targets.items()}
        for pool in pools.values():  # warm connections and first-request costs
            for _ in range(50):
                await pool.send()
        for rate in rates:
            samples = {n: Samples() for n in names}
            for number, name in common.alternate(rounds, names):
                pid = targets[name][1]
                cpu0 = tree_cpu(pid) if pid else 0.0
                lat, errors = await open_loop(pools[name], rate, seconds, number)
                s = samples[name]
                s.lat += lat
                s.errors += errors
                s.cpu += (tree_cpu(pid) - cpu0) if pid else 0.0
            direct = samples["direct"].lat
            fixed[f"{rate:g}"] = {n: s.report(direct, n != "direct") for n, s in samples.items()}
        closed: dict[str, list[float]] = {n: [] for n in names}
        for _, name in common.alternate(rounds, names):
            closed[name].append(await closed_loop(pools[name], 32, seconds / 2))
        for pool in pools.values():
            await pool.close()
        idle: dict[str, float] = {}
        for name, (_, pid, _) in targets.items():
            if pid and not name.startswith("floor-"):
                cpu0 = tree_cpu(pid)
                await trio.sleep(5.0)
                idle[name] = (tree_cpu(pid) - cpu0) / 5.0 * 1e3
    return {
        "fixed_rates": fixed,
        "closed_loop_32_req_per_s": {n: statistics.median(v) for n, v in closed.items()},
        "idle_cpu_ms_per_s": idle,
        "rounds": rounds,
        "seconds_per_round": seconds,
    }


def plot(result: dict[str, Any], png: Path) -> None:
    """Added p50 per rate (log: LiteLLM is three orders above), and CPU per request."""
    names = [n for n in result["closed_loop_32_req_per_s"] if n != "direct"]
    rates = list(result["fixed_rates"])
    groups = [f"{r} req/s" for r in rates]
    fixed = result["fixed_rates"]
    # A floor answers without a backend: its latency "added" over direct is negative.
    proxies = [n for n in names if not n.startswith("floor-")]
    added = {n: [max(fixed[r][n]["added_p50_ms"], 0.01) for r in rates] for n in proxies}
    plot_bars("Added latency p50 over direct", groups, added, "ms (log)", png, log=True)
    cpu = {n: [fixed[r][n]["cpu_ms_per_request"] for r in rates] for n in names}
    plot_bars(
        "CPU per request (floor-*: the server alone, no backend)",
        groups,
        cpu,
        "ms (log)",
        png.with_name("overhead-cpu.png"),
        log=True,
    )


def main(args: argparse.Namespace) -> None:
    installed = {"smg": SMG_BIN, "litellm": LITELLM_BIN}
    peers = [name for name, path in installed.items() if path.exists()]
    result = trio.run(measure, args, peers)
    png = common.write("overhead", result, args.out_dir)
    plot(result, png)
    names = [n for n in result["closed_loop_32_req_per_s"] if n != "direct"]
    rates = list(result["fixed_rates"])
    rows = []
    for rate in rates:
        for name in names:
            f = result["fixed_rates"][rate][name]
            added = (f["added_p50_ms"], f["added_p99_ms"])
            rows.append([rate, name, *added, f["cpu_ms_per_request"], f["errors"]])
    text = common.table(
        ["req/s", "proxy", "added p50 ms", "added p99 ms", "CPU ms/request", "errors"], rows
    )
    closed = result["closed_loop_32_req_per_s"]
    text += "\n\n" + common.table(
        ["target", "32 clients req/s", "idle CPU ms/s"],
        [[n, closed[n], result["idle_cpu_ms_per_s"].get(n)] for n in closed],
    )
    common.report("overhead", SEED_NOTE, text, png)
