"""`python -m load run`: the load generator against any OpenAI-compatible URL.

    python -m load run --target http://127.0.0.1:8000 --workload rag --rate 20 --duration 30 \
        --stream --slo ttft:500 --out /tmp/rag.json
    python -m load run --target URL --workload chat --concurrency 16 --duration 30
    python -m load run --target URL --workload hot --sweep 5,10,20,40 --duration 20

Open loop (`--rate`): send times are drawn in advance (Poisson, constant or gamma) and each
request is its own task, so a slow server never delays the next send (no coordinated
omission; past `--max-inflight` requests an arrival is counted as `client_overflow` instead
of queued). Closed loop (`--concurrency`): C clients, each sends when its last answer came.
A progress line shows done, errors, rate and the current p50/p99; the JSON result and a PNG
beside it (latency CDF, latency and throughput over time) are written at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import trio

from load import arrivals, drive
from load.client import Pool
from load.drive import Record
from load.harness import png_beside
from load.stats import goodput, parse_slos, percentile, summary
from load.workloads import WORKLOADS, Request, workload

TIMEOUT_S = 300.0  # a request given up on after this long counts as a `timeout` error


def requests(name: str, seed: int) -> Iterator[Request]:
    """The workload's requests, one arrival's worth after another, forever."""
    source = workload(name, seed)
    return itertools.chain.from_iterable(source.next() for _ in itertools.count())


async def open_loop(
    url: str, name: str, times: Sequence[float], stream: bool, seed: int, max_inflight: int
) -> drive.Run:
    """One arrival of workload `name` at each of `times` (an arrival may be a burst)."""
    source = workload(name, seed)
    async with Pool(url, timeout=TIMEOUT_S) as pool:
        plan = ((at, pool.prepare(request, stream)) for at in times for request in source.next())
        return await drive.open_loop(
            pool, plan, max_inflight=max_inflight, label=f"{name} open loop"
        )


async def closed_loop(
    url: str, name: str, concurrency: int, duration: float, stream: bool, seed: int
) -> drive.Run:
    """`concurrency` clients, each sending its next request when the last one is answered."""
    async with Pool(url, timeout=TIMEOUT_S) as pool:
        source = (pool.prepare(request, stream) for request in requests(name, seed))
        label = f"{name} closed loop"
        return await drive.closed_loop(pool, concurrency, source, seconds=duration, label=label)


def timeseries(
    records: Sequence[Record], seconds: float, bucket: float = 1.0
) -> dict[str, list[float]]:
    """Per `bucket` seconds (by send time): completions, p50 and p99 end-to-end latency."""
    last_send = max((r.start for r in records), default=0.0)
    buckets = max(1, min(math.ceil(seconds / bucket), int(last_send / bucket) + 1))
    latencies: list[list[float]] = [[] for _ in range(buckets)]
    errors = [0] * buckets
    for r in records:
        index = min(int(r.start / bucket), buckets - 1)
        if r.ok and r.e2e is not None:
            latencies[index].append(r.e2e)
        else:
            errors[index] += 1
    return {
        "t": [i * bucket for i in range(buckets)],
        "ok_per_s": [len(values) / bucket for values in latencies],
        "errors_per_s": [count / bucket for count in errors],
        "p50_ms": [percentile(values, 50) * 1e3 for values in latencies],
        "p99_ms": [percentile(values, 99) * 1e3 for values in latencies],
    }


def summarize(records: Sequence[Record], seconds: float, slos: dict[str, float]) -> dict[str, Any]:
    """The report of one run: latencies (ms), rates, errors by kind, spread over backends."""
    ok = [r for r in records if r.ok]

    def latencies(name: str) -> list[float]:
        values = [getattr(r, name) for r in ok]
        return [v for v in values if v is not None]

    timing_names = sorted({name for r in ok for name in r.timing})
    output_tokens = sum(r.output_tokens for r in ok)
    rows = [
        {"ok": 1.0 if r.ok else 0.0, "ttft": r.ttft, "itl": r.itl, "tpot": r.tpot, "e2e": r.e2e}
        for r in records
    ]
    return {
        "requests": len(records),
        "ok": len(ok),
        "seconds": seconds,
        "requests_per_s": len(ok) / seconds if seconds > 0 else float("nan"),
        "output_tokens_per_s": output_tokens / seconds if seconds > 0 else float("nan"),
        "goodput_per_s": goodput(rows, slos, seconds) if slos else None,
        "slos_ms": {name: limit * 1e3 for name, limit in slos.items()},
        "errors": dict(Counter(r.error for r in records if r.error)),
        "backends": dict(Counter(r.backend for r in ok if r.backend)),
        "routes": dict(Counter(r.route for r in ok if r.route)),
        "latency_ms": {
            name: summary(latencies(name), 1e3) for name in ("ttft", "itl", "tpot", "e2e")
        },
        "server_timing_ms": {
            name: summary([r.timing[name] for r in ok if name in r.timing], 1e3)
            for name in timing_names
        },
        "timeseries": timeseries(records, seconds),
    }


def print_summary(label: str, result: dict[str, Any]) -> None:
    lat = result["latency_ms"]
    print(
        f"{label}: {result['ok']}/{result['requests']} ok in {result['seconds']:.1f} s, "
        f"{result['requests_per_s']:.1f} req/s, {result['output_tokens_per_s']:.0f} tok/s"
    )
    for name in ("ttft", "itl", "tpot", "e2e"):
        s = lat[name]
        if s["count"]:
            print(
                f"  {name:5} p50 {s['p50']:9.1f}  p90 {s['p90']:9.1f}  p99 {s['p99']:9.1f}  "
                f"max {s['max']:9.1f} ms"
            )
    for name, s in result["server_timing_ms"].items():
        print(f"  proxy {name:9} p50 {s['p50']:7.3f}  p99 {s['p99']:7.3f} ms")
    if result["goodput_per_s"] is not None:
        print(f"  goodput {result['goodput_per_s']:.1f} req/s within {result['slos_ms']}")
    if result["errors"]:
        print(f"  errors: {result['errors']}")
    if result["backends"]:
        print(f"  backends: {result['backends']}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--workload", choices=WORKLOADS, default="mixed")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="open loop: arrivals per second")
    mode.add_argument("--concurrency", type=int, help="closed loop: clients kept busy")
    mode.add_argument("--sweep", help="open loop at each rate in turn, e.g. 5,10,20,40")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds (per rate)")
    parser.add_argument("--arrivals", choices=arrivals.PROCESSES, default="poisson")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape")
    parser.add_argument("--stream", action="store_true", help="stream responses (SSE)")
    parser.add_argument("--slo", action="append", default=[], help="METRIC:MS, e.g. ttft:500")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-inflight", type=int, default=2000)
    parser.add_argument("--out", type=Path, help="JSON result; a PNG is written beside it")


async def run_rate(args: argparse.Namespace, rate: float, slos: dict[str, float]) -> dict[str, Any]:
    times = arrivals.schedule(args.arrivals, rate, args.duration, args.seed, args.burstiness)
    run = await open_loop(
        args.target, args.workload, times, args.stream, args.seed, args.max_inflight
    )
    return {
        "rate": rate,
        **summarize(run.records, run.seconds, slos),
        "records": [r.as_dict() for r in run.records],
    }


async def execute(args: argparse.Namespace) -> dict[str, Any]:
    slos = parse_slos(args.slo)
    config = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"
    }
    if args.sweep:
        rates = [float(r) for r in args.sweep.split(",")]
        runs = []
        for rate in rates:
            result = await run_rate(args, rate, slos)
            print_summary(f"rate {rate:g}", result)
            runs.append(result)
        return {"config": config, "sweep": runs}
    if args.rate is not None:
        result = await run_rate(args, args.rate, slos)
    else:
        run = await closed_loop(
            args.target, args.workload, args.concurrency, args.duration, args.stream, args.seed
        )
        result = {
            **summarize(run.records, run.seconds, slos),
            "records": [r.as_dict() for r in run.records],
        }
    print_summary(args.workload, result)
    return {"config": config, **result}


def main(args: argparse.Namespace) -> None:
    if (args.rate is not None and args.rate <= 0) or (
        args.concurrency is not None and args.concurrency < 1
    ):
        raise SystemExit("run: --rate must be positive and --concurrency at least 1")
    try:
        result = trio.run(execute, args)
    except ValueError as exc:
        raise SystemExit(f"run: {exc}") from None
    if args.out:
        from load.plots import plot_run, plot_sweep

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        png = png_beside(args.out)
        if png is not None:
            (plot_sweep if "sweep" in result else plot_run)(result, png)
        print(f"wrote {args.out}" + (f" and {png}" if png else ""))
