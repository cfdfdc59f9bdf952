"""`python -m load bench overhead`: what a proxy costs, side by side on one simulated backend
(issue 10).

Targets: `direct` (the backend itself), `sluice` (`sluice serve`), and where installed in
their own venvs `smg` (`smg launch --policy round_robin`) and `litellm` (the LiteLLM proxy,
one worker). Two floors (load/floors.py) answer without any backend: `floor-hypercorn`, a
bare ASGI app on hypercorn's Trio worker (what serves Sluice's dashboard), and `floor-h11`,
h11 on bare Trio streams (what Sluice's data port is built on); their CPU per request is what
the server alone costs. The backend answers instantly, so what remains is HTTP and each
proxy's own work. Non-streaming one-token chats from the lean client (load/client.py).

1. Fixed open-loop rates: the targets take turns (rounds alternate) at each rate; added
   p50/p99 = the target's minus direct's over the same rounds (a floor answers without a
   backend: its "added" latency is negative); CPU per request from /proc (the process and
   its children), median of the rounds with their range.
2. Closed loop: 32 clients, requests per second, twice as many rounds as an open-loop rate;
   each target's median, and its ratio to SMG's taken round by round (the two ran seconds
   apart: the machine's drift between rounds, often larger than the difference, cancels).
3. Idle: CPU per second with no traffic (10 ms clock ticks: +-2 ms/s over 5 s).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from load import client, drive, harness
from load.harness import Bench, Scenario, Table
from load.plots import plot_bars
from load.processes import tree_cpu
from load.stats import Ranged, percentile, ranged


@dataclass
class Target:
    url: str
    pid: int | None  # None: not measured (the backend itself)
    headers: dict[str, str] = field(default_factory=dict)


async def start_targets(bench: Bench) -> dict[str, Target]:
    stack = bench.stack
    # The model is called "sim" on the backend too: SMG routes by the backend's model id.
    sim = await stack.sim(instant=True)
    targets = {"direct": Target(sim, None)}
    for name, url in (await bench.proxies("sluice", sim)).items():
        targets[name] = Target(url, stack.pids[url])
    if bench.comparing:  # two versions of Sluice: no floors, no peers
        return targets
    for kind in ("hypercorn", "h11"):
        url = await stack.floor(kind)
        targets[f"floor-{kind}"] = Target(url, stack.pids[url])
    smg = await stack.smg([sim], "round_robin")
    if smg is not None:
        targets["smg"] = Target(smg, stack.pids[smg])
    litellm = await stack.litellm(sim, "sim")
    if litellm is not None:
        targets["litellm"] = Target(litellm[0], stack.pids[litellm[0]], litellm[1])
    for name, target in list(targets.items()):
        if not await harness.answers(target.url, target.headers, client.ONE_TOKEN):
            print(f"{name} never answered a request; left out")
            del targets[name]
    return targets


@dataclass
class Samples:
    """One target's latencies, errors and CPU per request over its rounds at one rate."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    cpu_per_request: list[float] = field(default_factory=list)

    def report(self, direct: list[float]) -> dict[str, Any]:
        cpu = ranged(self.cpu_per_request)
        return {
            "p50_ms": percentile(self.latencies, 50) * 1e3,
            "p99_ms": percentile(self.latencies, 99) * 1e3,
            "added_p50_ms": (percentile(self.latencies, 50) - percentile(direct, 50)) * 1e3,
            "added_p99_ms": (percentile(self.latencies, 99) - percentile(direct, 99)) * 1e3,
            "cpu_ms_per_request": cpu.value * 1e3,
            "cpu_ms_per_request_range": [cpu.low * 1e3, cpu.high * 1e3],
            "errors": self.errors,
        }


async def measure(bench: Bench) -> dict[str, Any]:
    rates = bench.pick((100.0,), (25.0, 100.0, 200.0))
    rounds, seconds, idle_s = bench.rounds(2, 4), bench.pick(2.5, 8.0), bench.pick(2.0, 5.0)
    targets = await start_targets(bench)
    pools = {name: client.Pool(t.url, t.headers) for name, t in targets.items()}
    for pool in pools.values():
        await pool.warm()
    fixed: dict[str, Any] = {}
    for rate in rates:
        samples = {name: Samples() for name in targets}

        async def one(
            name: str, number: int, rate: float = rate, samples: dict[str, Samples] = samples
        ) -> dict[str, Any]:
            pid = targets[name].pid
            cpu0 = tree_cpu(pid) if pid else 0.0
            pool = pools[name]
            plan = drive.poisson(pool.prepare(client.ONE_TOKEN_REQUEST), rate, seconds, number)
            run = await drive.open_loop(pool, plan)
            s = samples[name]
            s.latencies += run.latencies()
            s.errors += run.errors
            if pid:
                s.cpu_per_request.append((tree_cpu(pid) - cpu0) / max(len(run.records), 1))
            return {}

        await bench.alternate(rounds, list(targets), one, f" {rate:g} req/s")
        direct = samples.pop("direct").latencies
        fixed[f"{rate:g}"] = {name: s.report(direct) for name, s in samples.items()}
    closed: dict[str, list[float]] = {name: [] for name in targets}

    async def closed_round(name: str, number: int) -> dict[str, Any]:
        pool = pools[name]
        run = await drive.closed_loop(pool, 32, drive.one_token(pool), seconds=seconds / 2)
        closed[name].append(run.ok / run.seconds)
        return {}

    await bench.alternate(2 * rounds, list(targets), closed_round, " 32 clients")
    smg = closed.get("smg")
    versus_smg = {
        name: list(ranged([a / b for a, b in zip(per_s, smg, strict=True)]))
        for name, per_s in closed.items()
        if smg and name != "smg"
    }
    for pool in pools.values():
        await pool.close()
    idle: dict[str, float] = {}
    for name, target in targets.items():
        if target.pid and not name.startswith("floor-"):
            harness.progress(f"overhead: {name} idle")
            cpu0 = tree_cpu(target.pid)
            await trio.sleep(idle_s)
            idle[name] = (tree_cpu(target.pid) - cpu0) / idle_s * 1e3
    return {
        "fixed_rates": fixed,
        "closed_loop_32_req_per_s": {n: statistics.median(v) for n, v in closed.items()},
        "closed_loop_32_rounds": closed,
        "closed_loop_32_vs_smg_by_round": versus_smg,
        "idle_cpu_ms_per_s": idle,
        "rounds": rounds,
        "seconds_per_round": seconds,
    }


def by_rate(result: dict[str, Any]) -> Table:
    """One row a target: its figures at every rate, and their ratio to SMG's at that rate."""
    fixed = result["fixed_rates"]
    rates = list(fixed)
    smg = "smg" if all("smg" in fixed[r] for r in rates) else None

    def across(name: str, key: str) -> str:
        return " / ".join(f"{fixed[r][name][key]:.2f}" for r in rates)

    def versus(name: str, key: str) -> str | None:
        if smg is None or name == smg or (key == "added_p50_ms" and name.startswith("floor-")):
            return None  # a floor has no backend behind it: its "added" is not a proxy's
        ratios = [fixed[r][name][key] / fixed[r][smg][key] for r in rates]
        return " / ".join(f"{ratio:.2f}x" for ratio in ratios)

    rows = [
        [name, across(name, "cpu_ms_per_request"), versus(name, "cpu_ms_per_request"),
         across(name, "added_p50_ms"), versus(name, "added_p50_ms"),
         across(name, "added_p99_ms"), sum(fixed[r][name]["errors"] for r in rates)]
        for name in fixed[rates[0]]
    ]  # fmt: skip
    return Table(
        f"open loop at {' / '.join(rates)} req/s, {result['rounds']} alternating rounds of "
        f"{result['seconds_per_round']:g} s per rate; CPU per request: the median of the rounds; "
        "added: the target's latency minus direct's; x SMG: over SMG's at the same rate",
        ["target", "CPU ms/request", "x SMG", "added p50 ms", "x SMG", "added p99 ms", "errors"],
        rows,
    )


def tables(result: dict[str, Any]) -> list[Table]:
    rows = []
    for rate, by_target in result["fixed_rates"].items():
        for name, f in by_target.items():
            cpu = Ranged(f["cpu_ms_per_request"], *f["cpu_ms_per_request_range"])
            rows.append([rate, name, f["added_p50_ms"], f["added_p99_ms"], cpu, f["errors"]])
    closed, idle = result["closed_loop_32_req_per_s"], result["idle_cpu_ms_per_s"]
    versus_smg = result.get("closed_loop_32_vs_smg_by_round", {})
    rounds = len(next(iter(result["closed_loop_32_rounds"].values())))
    return [
        by_rate(result),
        Table(
            f"32 closed-loop clients, {rounds} alternating rounds of "
            f"{result['seconds_per_round'] / 2:g} s: requests/s, the median of the rounds, and "
            "the ratio to SMG's taken round by round (median, range); idle: CPU with no traffic",
            ["target", "32 clients, req/s", "vs SMG by round (range)", "idle CPU ms/s"],
            [[n, closed[n], _ratio(versus_smg.get(n)), idle.get(n)] for n in closed],
        ),
        Table(
            f"open loop, {result['rounds']} alternating rounds of "
            f"{result['seconds_per_round']:g} s per rate; CPU: median of the rounds (range)",
            ["req/s", "target", "added p50 ms", "added p99 ms", "CPU ms/request", "errors"],
            rows,
            digits=2,
        ),
    ]


def _ratio(ratio: list[float] | None) -> str | None:
    return None if ratio is None else "{:.3f}x ({:.3f}-{:.3f})".format(*ratio)


def plot(result: dict[str, Any], png: Path) -> None:
    """Added p50 per rate (log: LiteLLM is three orders above), and CPU per request."""
    fixed = result["fixed_rates"]
    rates = list(fixed)
    groups = [f"{r} req/s" for r in rates]
    names = list(fixed[rates[0]])
    proxies = [n for n in names if not n.startswith("floor-")]
    added = {n: [max(fixed[r][n]["added_p50_ms"], 0.01) for r in rates] for n in proxies}
    plot_bars("Added latency p50 over direct", groups, added, "ms (log)", png, log=True)
    plot_bars(
        "CPU per request (floor-*: the server alone, no backend)",
        groups,
        {n: [fixed[r][n]["cpu_ms_per_request"] for r in rates] for n in names},
        "ms (log)",
        png.with_name("overhead-cpu.png"),
        log=True,
    )


SCENARIO = Scenario(
    name="overhead",
    reproduces="issue 10",
    about="direct vs Sluice vs the floors vs SMG vs LiteLLM: added latency, CPU per request",
    reference=(
        "issue 10 (2026-11-22, same method): added p50 at 25 req/s Sluice 1.7 ms, SMG 0.9,\n"
        "LiteLLM 11.3 (it documents 2-12 ms p50); CPU/request Sluice 1.5-1.8 ms, SMG 0.6,\n"
        "LiteLLM 9.5; 32 clients Sluice 1,183 req/s, SMG 1,776, LiteLLM 103; idle CPU Sluice\n"
        "17.5 ms/s, SMG 5, LiteLLM 2.5. Targets: Sluice <= 1.0 ms CPU/request, <= 1 ms added\n"
        "p50, within 2x SMG, idle <= 5 ms/s."
    ),
    measure=measure,
    tables=tables,
    plot=plot,
)
