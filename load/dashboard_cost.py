"""What open dashboard pages cost the proxy: CPU per proxied request with no page open and
with `--pages` pages listening to `/api/events`, side by side in one run.

One simulated backend with zero GPU time, one `sluice serve` in front of it. Rounds
alternate between the two modes on the same proxy process; each round keeps
`--concurrency` clients busy for `--seconds`, counts completed requests and reads the
proxy's CPU time from /proc. A "page" is what a browser tab costs the proxy: an open
server-sent-events stream, read as fast as it comes (drawing it is the browser's CPU, not
the proxy's).

    python -m load dashboard-cost --rounds 10 --seconds 3 --pages 5

Target (issue 8): five pages cost at most 3% more proxy CPU per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from dataclasses import dataclass

import httpx
import trio

from load.detector_cost import Round, one_round
from load.processes import free_port, start_instant_sim, start_process, stop_all


@dataclass
class Pages:
    """Browser tabs stand-ins: open SSE streams, read as they come and thrown away. Parsing
    and drawing is the browser's CPU, on the operator's machine: here it would only take
    CPU from the proxy on the same two cores."""

    events: int = 0
    listening: int = 0  # pages that got their first snapshot this round

    async def listen(self, client: httpx.AsyncClient, url: str) -> None:
        first = True
        async with client.stream("GET", url + "/api/events") as response:
            response.raise_for_status()
            async for chunk in response.aiter_raw():
                received = chunk.count(b"data: ")  # a close count: enough to see them flow
                self.events += received
                if first and received:
                    self.listening += 1
                    first = False


async def start_proxy_with_dashboard(
    processes: list[subprocess.Popen[bytes]], backend: str
) -> tuple[str, str]:
    """`sluice serve`; the proxy on a port chosen here, the dashboard's read from its output."""
    port = free_port()
    args = ["serve", "--backend", backend, "--port", str(port), "--dashboard-port", "0"]
    dashboard = await start_process(
        [*args, "--log-level", "warning"], b"Sluice dashboard", processes
    )
    return f"http://127.0.0.1:{port}", dashboard


async def run(args: argparse.Namespace) -> dict[str, float]:
    processes: list[subprocess.Popen[bytes]] = []
    try:
        sim_url = await start_instant_sim(processes)
        proxy_url, dashboard_url = await start_proxy_with_dashboard(processes, sim_url)
        pid = processes[-1].pid
        rounds: list[Round] = []
        pages = Pages()
        limits = httpx.Limits(max_connections=args.concurrency * 2)
        async with (
            httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) as client,
            httpx.AsyncClient(timeout=None, trust_env=False) as browser,
        ):
            await one_round(client, proxy_url, pid, "warm-up", args.concurrency, 1.0)
            for index in range(args.rounds):
                order = ("0 pages", "pages") if index % 2 == 0 else ("pages", "0 pages")
                for mode in order:
                    async with trio.open_nursery() as nursery:
                        if mode == "pages":
                            pages.listening = 0
                            for _ in range(args.pages):
                                nursery.start_soon(pages.listen, browser, dashboard_url)
                            # Every page has its first snapshot before the round starts.
                            while pages.listening < args.pages:
                                await trio.sleep(0.05)
                        rounds.append(
                            await one_round(
                                client, proxy_url, pid, mode, args.concurrency, args.seconds
                            )
                        )
                        nursery.cancel_scope.cancel()
    finally:
        stop_all(processes)
    result = summarize(rounds)
    result["events_received"] = float(pages.events)
    return result


def summarize(rounds: list[Round]) -> dict[str, float]:
    def median(mode: str, attribute: str) -> float:
        return float(statistics.median(getattr(r, attribute) for r in rounds if r.mode == mode))

    result = {
        "no_page_requests_per_s": median("0 pages", "per_second"),
        "pages_requests_per_s": median("pages", "per_second"),
        "no_page_cpu_us_per_request": median("0 pages", "cpu_us_per_request"),
        "pages_cpu_us_per_request": median("pages", "cpu_us_per_request"),
        "errors": float(sum(r.errors for r in rounds)),
    }
    result["cpu_cost_percent"] = (
        result["pages_cpu_us_per_request"] / result["no_page_cpu_us_per_request"] - 1
    ) * 100
    # Each pair of neighbouring rounds saw the same machine: their ratio is what drift on a
    # shared machine disturbs least.
    paired = []
    for first, second in zip(rounds[::2], rounds[1::2], strict=True):
        pages, none = (first, second) if first.mode == "pages" else (second, first)
        paired.append(pages.cpu_us_per_request / none.cpu_us_per_request - 1)
    result["cpu_cost_percent_paired_median"] = statistics.median(paired) * 100
    result["throughput_cost_percent"] = (
        1 - result["pages_requests_per_s"] / result["no_page_requests_per_s"]
    ) * 100
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=10, help="rounds per mode")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one round")
    parser.add_argument("--concurrency", type=int, default=16, help="clients kept busy")
    parser.add_argument("--pages", type=int, default=5, help="dashboard pages in 'pages' mode")


def main(args: argparse.Namespace) -> None:
    result = trio.run(run, args)
    print(json.dumps(result, indent=2))
    print(
        f"{args.pages} dashboard pages vs none: proxy CPU "
        f"{result['pages_cpu_us_per_request']:.0f} vs "
        f"{result['no_page_cpu_us_per_request']:.0f} µs/request "
        f"({result['cpu_cost_percent']:+.1f}%; paired rounds: "
        f"{result['cpu_cost_percent_paired_median']:+.1f}%), throughput "
        f"{result['pages_requests_per_s']:.0f} vs {result['no_page_requests_per_s']:.0f} req/s "
        f"({result['throughput_cost_percent']:+.1f}%)"
    )
