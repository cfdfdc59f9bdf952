"""What the event-loop stall detector costs.

    .venv/bin/python -m load.bench_stall_detector [--tasks 100] [--steps 2000] [--repeats 7]

1. Per task step: a trio.run of `--tasks` tasks that each take `--steps` bare steps
   (`await trio.sleep(0)`), with no monitor, with the monitor's probe only (instrument off)
   and with probe and instrument, interleaved so drift hits every variant alike. Reports the
   median time per step and the instrument's cost per step.
2. Per probe tick: re-arming the stack alarm (`signal.setitimer`, what the monitor does)
   against `faulthandler.dump_traceback_later` (the alternative it rejected), called once
   per probe interval as the probe does, and the share of the loop's time that costs.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import statistics
import tempfile
import time
from collections.abc import Callable

import trio
import trio.lowlevel

from app.observe.loop_monitor import PROBE_INTERVAL_S, LoopMonitor
from app.observe.metrics import Metrics

THRESHOLD_MS = 10.0
VARIANTS = ("no monitor", "probe only", "probe + instrument")


async def _take_steps(steps: int) -> None:
    for _ in range(steps):
        await trio.lowlevel.checkpoint()


async def _run_tasks(variant: str, tasks: int, steps: int) -> float:
    """Seconds per task step."""
    async with trio.open_nursery() as nursery:
        if variant != "no monitor":
            monitor = LoopMonitor(
                Metrics(), THRESHOLD_MS, instrument=variant == "probe + instrument"
            )
            await nursery.start(monitor.run)
        started = time.perf_counter()
        async with trio.open_nursery() as workers:
            for _ in range(tasks):
                workers.start_soon(_take_steps, steps)
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return elapsed / (tasks * steps)


def bench_steps(tasks: int, steps: int, repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    trio.run(_run_tasks, "no monitor", tasks, steps // 10)  # warm-up
    for repeat in range(repeats):
        # Rotate the order so no variant always runs first (cold) or last.
        order = VARIANTS[repeat % 3 :] + VARIANTS[: repeat % 3]
        for variant in order:
            samples[variant].append(trio.run(_run_tasks, variant, tasks, steps))
    return {variant: statistics.median(values) for variant, values in samples.items()}


def _median_call_s(call: Callable[[], object], calls: int) -> float:
    durations = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        durations.append(time.perf_counter() - started)
        # The probe's cadence: an idle CPU between calls is part of the cost (thread start-up).
        time.sleep(PROBE_INTERVAL_S)
    return statistics.median(durations)


def bench_rearm(calls: int) -> dict[str, float]:
    timeout_s = (THRESHOLD_MS / 1000) + PROBE_INTERVAL_S
    with tempfile.TemporaryFile() as dump:
        later = _median_call_s(
            lambda: faulthandler.dump_traceback_later(timeout_s, file=dump.fileno()), calls
        )
        faulthandler.cancel_dump_traceback_later()
    faulthandler.register(signal.SIGALRM, all_threads=True, chain=False)
    try:
        alarm = _median_call_s(lambda: signal.setitimer(signal.ITIMER_REAL, timeout_s), calls)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.unregister(signal.SIGALRM)
    return {"signal.setitimer": alarm, "faulthandler.dump_traceback_later": later}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rearm-calls", type=int, default=400)
    args = parser.parse_args()

    per_step = bench_steps(args.tasks, args.steps, args.repeats)
    bare = per_step["no monitor"]
    print(f"1. task steps: {args.tasks} tasks x {args.steps} steps, median of {args.repeats}")
    print(f"   {'variant':<20} {'us/step':>8} {'vs bare':>8}")
    for variant, seconds in per_step.items():
        print(f"   {variant:<20} {seconds * 1e6:8.2f} {seconds / bare:8.3f}")
    instrument = per_step["probe + instrument"] - per_step["probe only"]
    print(f"   instrument cost: {instrument * 1e6:.2f} us/step ({instrument / bare:.1%} of a step)")

    rearm = bench_rearm(args.rearm_calls)
    interval_ms = PROBE_INTERVAL_S * 1e3
    print(f"2. probe re-arm, median of {args.rearm_calls} calls, one per {interval_ms:g} ms")
    print(f"   {'method':<36} {'us/call':>8} {'loop share':>11}")
    for method, seconds in rearm.items():
        print(f"   {method:<36} {seconds * 1e6:8.2f} {seconds / PROBE_INTERVAL_S:11.2%}")


if __name__ == "__main__":
    main()
