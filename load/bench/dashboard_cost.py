"""`python -m load bench dashboard-cost`: what open dashboard pages cost the proxy (issue 8).

One instant simulated backend, one `sluice serve` in front of it. Rounds alternate between
no page open and `--pages` pages listening to `/api/events` on the same proxy process; each
round keeps 16 lean-client connections busy, counts answers and reads the proxy's CPU from
/proc. A "page" is what a browser tab costs the proxy: an open server-sent-events stream,
read as fast as it comes (drawing it is the browser's CPU, on the operator's machine).
Target: five pages cost at most 3% more proxy CPU per request.
"""

from __future__ import annotations

import argparse
from typing import Any

import trio

from load import client, harness
from load.harness import Bench, Scenario, Table

CLIENTS = 16
TARGET = "five pages cost at most +3% CPU per request"


class Pages:
    """Stand-ins for browser tabs: SSE streams read as they come and thrown away."""

    def __init__(self) -> None:
        self.events = 0
        self.listening = 0  # pages that got their first snapshot this round

    async def listen(self, url: str) -> None:
        first = True
        async with client.streaming(url + "/api/events") as page:
            if page.status != 200:
                raise RuntimeError(f"{url}/api/events answered {page.status}")
            while (chunk := await page.read_chunk()) is not None:
                received = chunk.count(b"data: ")  # a close count: enough to see them flow
                self.events += received
                if first and received:
                    self.listening += 1
                    first = False


async def measure(bench: Bench) -> dict[str, Any]:
    pages_open, seconds = bench.args.pages, bench.pick(1.5, 3.0)
    sim = await bench.stack.sim(instant=True)
    proxy = await bench.stack.proxy(sim)
    pid = bench.stack.pids[proxy]
    await harness.wait_healthy(proxy)  # the dashboard's line is printed by then
    dashboard = bench.stack.dashboard(proxy)
    pool = client.Pool(proxy)
    await pool.warm()
    pages = Pages()
    modes = ("0 pages", f"{pages_open} pages")

    async def one(mode: str, _: int) -> dict[str, Any]:
        count = 0 if mode == modes[0] else pages_open
        async with trio.open_nursery() as nursery:
            pages.listening = 0
            for _ in range(count):
                nursery.start_soon(pages.listen, dashboard)
            while pages.listening < count:
                await trio.sleep(0.05)  # every page has its first snapshot first
            row = await harness.busy_round(pool, pid, CLIENTS, seconds)
            nursery.cancel_scope.cancel()
        return row

    rows = await bench.alternate(bench.rounds(4, 10), modes, one)
    await pool.close()
    return {
        "pages": pages_open,
        "events_received": pages.events,
        **harness.busy_summary(rows, modes[1], modes[0]),
    }


def tables(result: dict[str, Any]) -> list[Table]:
    what = f"{result['pages']} pages vs none ({result['events_received']:,} events read)"
    return [harness.busy_table(result, what, CLIENTS, TARGET)]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=int, default=5, help="pages open (default 5)")


SCENARIO = Scenario(
    name="dashboard-cost",
    reproduces="issue 8",
    about="proxy CPU per request with no dashboard page open vs 5 pages listening",
    reference="issue 8: five open dashboard pages cost at most 3% more proxy CPU per request.",
    measure=measure,
    tables=tables,
    options=options,
)
