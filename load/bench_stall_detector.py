"""What the event-loop stall detector costs.

    .venv/bin/python -m load.bench_stall_detector [--tasks 100] [--steps 2000] [--repeats 7]

1. Per task step: a trio.run of `--tasks` tasks that each take `--steps` bare steps
   (`trio.lowlevel.checkpoint()`), with no monitor, with the monitor's probe only (instrument off)
   and with probe and instrument, interleaved so drift hits every variant alike. Reports the
   median time per step and the instrument's cost per step.
2. Per probe tick: re-arming the stack alarm, called once per probe interval as the probe
   does, between idle waits (`time.sleep`) and between busy spells (Python work), side by
   side: the thread-directed POSIX timer the monitor uses (`timer_settime` via ctypes),
   `signal.setitimer` (process-directed, what it used before) and
   `faulthandler.dump_traceback_later` (rejected: a thread hand-off per re-arm).
3. Per sample of the loop thread's clocks (stall causes): a light sample (after I/O waits)
   and a full one (probe ticks), with the worker threads a proxy has.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import trio
import trio.lowlevel

from app.observe.loop_monitor import PROBE_INTERVAL_S, LoopMonitor
from app.observe.metrics import Metrics
from app.observe.thread_clocks import ThreadClocks
from app.observe.thread_timer import ThreadTimer

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


def _busy(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def _median_call_s(call: Callable[[], object], calls: int, between: Callable[[], None]) -> float:
    durations = []
    for _ in range(calls):
        between()
        started = time.perf_counter()
        call()
        durations.append(time.perf_counter() - started)
    return statistics.median(durations)


CADENCES: dict[str, Callable[[], None]] = {
    # The probe's cadence on an idle loop: a cold CPU between calls is part of the cost.
    "idle": lambda: time.sleep(PROBE_INTERVAL_S),
    # A loaded loop: Python work between calls, as between two probe ticks under traffic.
    "busy": lambda: _busy(PROBE_INTERVAL_S),
}


def bench_rearm(calls: int) -> dict[str, dict[str, float]]:
    timeout_s = (THRESHOLD_MS / 1000) + PROBE_INTERVAL_S
    timer = ThreadTimer.create(threading.get_native_id(), signal.SIGALRM, timeout_s)
    if isinstance(timer, str):
        raise SystemExit(f"no thread-directed timer here: {timer}")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryFile() as dump:
        faulthandler.register(signal.SIGALRM, file=dump.fileno(), all_threads=False, chain=False)
        try:
            for cadence, between in CADENCES.items():
                # Interleaved per cadence so drift on a shared machine hits each alike.
                results[cadence] = {
                    "timer_settime (thread-directed)": _median_call_s(timer.arm, calls, between),
                    "signal.setitimer (process-directed)": _median_call_s(
                        lambda: signal.setitimer(signal.ITIMER_REAL, timeout_s), calls, between
                    ),
                    "faulthandler.dump_traceback_later": _median_call_s(
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


def bench_clock_samples(calls: int, threads: int) -> dict[str, float]:
    """Median µs of a light and a full sample, with `threads` idle worker threads alive."""
    clocks = ThreadClocks.open()
    if isinstance(clocks, str):
        raise SystemExit(f"no thread clocks here: {clocks}")
    stop = threading.Event()
    workers = [threading.Thread(target=stop.wait) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        clocks.sample(full=True)  # list the threads once
        light = _median_call_s(clocks.sample, calls, lambda: _busy(0.0005))
        full = _median_call_s(lambda: clocks.sample(full=True), calls, lambda: _busy(0.0005))
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        clocks.close()
    return {"light sample": light, f"full sample ({threads} other threads)": full}


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

    interval_ms = PROBE_INTERVAL_S * 1e3
    print(f"2. probe re-arm, median of {args.rearm_calls} calls, one per {interval_ms:g} ms")
    print(f"   {'cadence':<8} {'method':<38} {'us/call':>8} {'loop share':>11}")
    for cadence, methods in bench_rearm(args.rearm_calls).items():
        for method, seconds in methods.items():
            share = seconds / PROBE_INTERVAL_S
            print(f"   {cadence:<8} {method:<38} {seconds * 1e6:8.2f} {share:11.2%}")

    print(f"3. loop thread clock samples (stall causes), median of {args.rearm_calls} calls")
    for kind, seconds in bench_clock_samples(args.rearm_calls, threads=6).items():
        print(f"   {kind:<38} {seconds * 1e6:8.2f} us")


if __name__ == "__main__":
    main()
