"""`/metrics` rendered in slices (app/observe/metrics.py `exposition_in_slices`): the text
is byte for byte what prometheus_client renders in one piece, families cut in pieces keep a
single HELP and TYPE, and the loop runs other tasks between the pieces of a large family."""

from __future__ import annotations

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.observe.metrics import SERIES_PER_STEP, exposition_in_slices

BACKENDS = 1_000


def fleet_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    healthy = Gauge("fleet_healthy", "Healthy or not", ["backend"], registry=registry)
    latency = Histogram("fleet_latency_seconds", "Latency", ["backend"], registry=registry)
    doc = 'Requests "answered"\nby code'  # escaped in HELP
    requests = Counter("fleet_requests", doc, ["code"], registry=registry)
    Gauge("fleet_empty", "A labelled gauge with no child yet", ["backend"], registry=registry)
    Gauge("fleet_one", "An unlabelled gauge", registry=registry).set(3.5)
    for n in range(BACKENDS):
        healthy.labels(f"http://10.0.{n // 250}.{n % 250}:8000").set(n % 2)
    for n in range(40):
        latency.labels(f"http://10.0.0.{n}:8000").observe(n / 100)
    requests.labels("200").inc(7)
    return registry


async def test_the_sliced_text_is_prometheus_clients_own() -> None:
    registry = fleet_registry()
    sliced = await exposition_in_slices(registry)
    assert sliced == generate_latest(registry)
    assert sliced.count(b"# TYPE fleet_healthy gauge\n") == 1
    assert sliced.count(b"# HELP fleet_empty ") == 1


async def test_a_large_family_is_formatted_a_slice_a_step() -> None:
    registry = fleet_registry()
    steps = 0
    done = False

    async def beside() -> None:
        nonlocal steps
        while not done:
            steps += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(beside)
        await trio.lowlevel.checkpoint()
        started = steps
        await exposition_in_slices(registry)
        done = True
    # The 1,000 gauges alone are four slices; the histogram's ~600 series two more.
    assert steps - started >= BACKENDS // SERIES_PER_STEP + 2
