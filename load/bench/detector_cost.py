"""`python -m load bench detector-cost`: what the stall detector costs (issue 4).

1. The proxy: two `sluice serve` in front of one instant simulated backend, differing only in
   `--stall-instrument` / `--no-stall-instrument` (the per-step timer); rounds alternate,
   each keeps 16 lean-client connections busy and reads the proxy's CPU from /proc.
   Target: the instrument costs at most 3% of throughput.
2. In process, per task step: a trio.run of 100 tasks that each take bare steps
   (`trio.lowlevel.checkpoint()`), with no monitor, the monitor's probe only, and probe and
   instrument, in rotating order so drift hits every variant alike.
3. In process, per probe tick: re-arming the stack alarm once per probe interval, between
   idle waits and between busy spells: the thread-directed POSIX timer the monitor uses,
   `signal.setitimer` (process-directed, what it used before) and
   `faulthandler.dump_traceback_later` (rejected: a thread hand-off per re-arm).
4. In process, per sample of the loop thread's clocks (stall causes): a light sample and a
   full one, with the worker threads a proxy has.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import trio
import trio.lowlevel

from app.cli.rooms import RoomMetrics
from app.observe.loop_monitor import PROBE_INTERVAL_S, LoopMonitor
from app.observe.thread_clocks import ThreadClocks
from app.observe.thread_timer import ThreadTimer
from load import client, harness
from load.harness import Bench, Scenario, Table

MODES = {"on": "--stall-instrument", "off": "--no-stall-instrument"}
CLIENTS = 16
THRESHOLD_MS = 10.0
STEP_VARIANTS = ("no monitor", "probe only", "probe + instrument")
TARGET = "the instrument costs at most 3% of throughput"


async def proxy_cost(bench: Bench) -> dict[str, Any]:
    sim = await bench.stack.sim(instant=True)
    urls = {mode: await bench.stack.proxy(sim, flag) for mode, flag in MODES.items()}
    pools = {mode: client.Pool(url) for mode, url in urls.items()}
    for pool in pools.values():
        await pool.warm()
    seconds = bench.pick(1.5, 3.0)

    async def one(mode: str, _: int) -> dict[str, Any]:
        return await harness.busy_round(pools[mode], bench.stack.pids[urls[mode]], CLIENTS, seconds)

    rows = await bench.alternate(bench.rounds(4, 10), list(MODES), one)
    for pool in pools.values():
        await pool.close()
    return harness.busy_summary(rows, "on", "off")


async def _take_steps(steps: int) -> None:
    for _ in range(steps):
        await trio.lowlevel.checkpoint()


async def _run_tasks(variant: str, tasks: int, steps: int) -> float:
    """Seconds per task step."""
    async with trio.open_nursery() as nursery:
        if variant != "no monitor":
            instrument = variant == "probe + instrument"
            await nursery.start(
                LoopMonitor(RoomMetrics.create().loop, THRESHOLD_MS, instrument=instrument).run
            )
        started = time.perf_counter()
        async with trio.open_nursery() as workers:
            for _ in range(tasks):
                workers.start_soon(_take_steps, steps)
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return elapsed / (tasks * steps)


def step_costs(tasks: int, steps: int, repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {variant: [] for variant in STEP_VARIANTS}
    trio.run(_run_tasks, "no monitor", tasks, steps // 10)  # warm-up
    for repeat in range(repeats):
        order = STEP_VARIANTS[repeat % 3 :] + STEP_VARIANTS[: repeat % 3]
        for variant in order:
            samples[variant].append(trio.run(_run_tasks, variant, tasks, steps))
    return {variant: statistics.median(values) * 1e6 for variant, values in samples.items()}


def _busy(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def _median_call_us(call: Callable[[], object], calls: int, between: Callable[[], None]) -> float:
    durations = []
    for _ in range(calls):
        between()
        started = time.perf_counter()
        call()
        durations.append(time.perf_counter() - started)
    return statistics.median(durations) * 1e6


CADENCES: dict[str, Callable[[], None]] = {
    # The probe's cadence on an idle loop: a cold CPU between calls is part of the cost.
    "idle": lambda: time.sleep(PROBE_INTERVAL_S),
    # A loaded loop: Python work between calls, as between two probe ticks under traffic.
    "busy": lambda: _busy(PROBE_INTERVAL_S),
}


def rearm_costs(calls: int) -> dict[str, dict[str, float]]:
    timeout_s = (THRESHOLD_MS / 1000) + PROBE_INTERVAL_S
    timer = ThreadTimer.create(threading.get_native_id(), signal.SIGALRM, timeout_s)
    if isinstance(timer, str):
        return {}  # no thread-directed timer on this platform: nothing to compare
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryFile() as dump:
        faulthandler.register(signal.SIGALRM, file=dump.fileno(), all_threads=False, chain=False)
        try:
            for cadence, between in CADENCES.items():
                results[cadence] = {
                    "timer_settime (thread-directed)": _median_call_us(timer.arm, calls, between),
                    "signal.setitimer (process-directed)": _median_call_us(
                        lambda: signal.setitimer(signal.ITIMER_REAL, timeout_s), calls, between
                    ),
                    "faulthandler.dump_traceback_later": _median_call_us(
                        lambda: faulthandler.dump_traceback_later(timeout_s, file=dump.fileno()),
                        calls // 4,
                        between,
                    ),
                }
                faulthandler.cancel_dump_traceback_later()
                signal.setitimer(signal.ITIMER_REAL, 0)
                timer.disarm()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            timer.disarm()
            faulthandler.unregister(signal.SIGALRM)
            timer.close()
    return results


def clock_sample_costs(calls: int, threads: int) -> dict[str, float]:
    clocks = ThreadClocks.open()
    if isinstance(clocks, str):
        return {}
    stop = threading.Event()
    workers = [threading.Thread(target=stop.wait) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        clocks.sample(full=True)  # list the threads once
        light = _median_call_us(clocks.sample, calls, lambda: _busy(0.0005))
        full = _median_call_us(lambda: clocks.sample(full=True), calls, lambda: _busy(0.0005))
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        clocks.close()
    return {"light sample": light, f"full sample ({threads} other threads)": full}


def in_process(bench: Bench) -> dict[str, Any]:
    harness.progress("detector-cost: in process")
    logging.getLogger("sluice.stalls").setLevel(logging.ERROR)  # the stalls it sees: ours
    calls = bench.pick(100, 400)
    return {
        "step_us": step_costs(100, bench.pick(500, 2000), bench.pick(3, 7)),
        "rearm_us": rearm_costs(calls),
        "clock_sample_us": clock_sample_costs(calls, threads=6),
    }


async def measure(bench: Bench) -> dict[str, Any]:
    return {"proxy": await proxy_cost(bench)}


def tables(result: dict[str, Any]) -> list[Table]:
    local = result["in_process"]
    steps = local["step_us"]
    bare = steps["no monitor"]
    interval_ms = PROBE_INTERVAL_S * 1e3
    return [
        harness.busy_table(result["proxy"], "instrument on vs off", CLIENTS, TARGET),
        Table(
            "in process: a task step, 100 tasks",
            ["variant", "us/step", "vs bare"],
            [[v, us, us / bare] for v, us in steps.items()],
            digits=3,
        ),
        Table(
            f"in process: re-arming the stack alarm, one call per {interval_ms:g} ms",
            ["cadence", "method", "us/call", "loop share %"],
            [
                [cadence, method, us, us / (interval_ms * 10)]
                for cadence, methods in local["rearm_us"].items()
                for method, us in methods.items()
            ],
            digits=2,
        ),
        Table(
            "in process: the loop thread's clocks (stall causes)",
            ["sample", "us"],
            [[kind, us] for kind, us in local["clock_sample_us"].items()],
            digits=2,
        ),
    ]  # fmt: skip


SCENARIO = Scenario(
    name="detector-cost",
    reproduces="issue 4",
    about="the stall detector: proxy CPU with the step timer on vs off; step, alarm, clocks",
    reference=(
        "issue 4: the stall instrument may cost at most 3% of proxy throughput. DESIGN.md: a\n"
        "trio Instrument timing before/after each task step costs ~1.2 us a step; arming\n"
        "faulthandler.dump_traceback_later ~40 us, so the monitor re-arms from its probe."
    ),
    measure=measure,
    in_process=in_process,
    tables=tables,
)
