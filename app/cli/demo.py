"""`sluice demo`: two models on simulated GPUs, the proxy with its dashboard, and background
traffic, each simulated GPU and the traffic in a process of its own.

The page a newcomer opens first shows the proxy's event loop: with the simulated GPUs and
the clients on that same loop, part of what it showed was theirs (seen: 117 ms worst lag
and a 220 ms p99 spike during the demo's own burst). So this process runs only the proxy
and its dashboard; every other part is a child (`python -m app.cli.demo sim|traffic SETTINGS`)
that prints what the parent waits for on its first line, takes commands on its stdin
(`burst`: the page's button) and stops at end of file there, so that no child outlives its
parent however the parent ends. Ctrl-C in a terminal reaches every process of the group:
the children ignore it, the parent stops the traffic, drains its requests (their simulated
GPUs still answering), then closes the children's pipes and waits for them.

The fleet: `sim-large` (alias `chat-default`) on every simulated GPU but the last, and
`sim-small` (ChatML, a 32k window) on the last; with `--demo-backends 1` one simulated GPU
serves both names, a backend in two pools.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from app.cli.serve import run_until_stopped
from app.cli.sluice import Sluice, print_urls, run_then_cancel, stop_on_signal
from app.config import ModelConfig, Settings
from app.sim.server import serve_sim
from app.sim.settings import SimSettings
from app.sim.traffic import DemoTraffic

log = logging.getLogger("sluice.demo")

LARGE, SMALL, ALIAS = "sim-large", "sim-small", "chat-default"
SMALL_WINDOW = 32768
# How long a child may take to start (imports, a free port) and to stop once told.
CHILD_START_S = 60.0
CHILD_STOP_S = 3.0
BURST = b"burst\n"
CHILD_NICENESS = 19


def demo_models(urls: Sequence[str]) -> tuple[ModelConfig, ModelConfig]:
    large = tuple(urls[:-1]) or tuple(urls)
    return (
        ModelConfig(LARGE, large, aliases=(ALIAS,)),
        ModelConfig(SMALL, (urls[-1],), chat_template="chatml", max_model_len=SMALL_WINDOW),
    )


class Child:
    """One child process: what its first stdout line said, and commands to its stdin."""

    def __init__(self, process: trio.Process, ready: str) -> None:
        self.process = process
        self.ready = ready
        self._commands, self._to_send = trio.open_memory_channel[bytes](1)

    def send_nowait(self, command: bytes) -> bool:
        """Queue `command` for the child; False when one is already waiting to go."""
        try:
            self._commands.send_nowait(command)
        except trio.WouldBlock:
            return False
        return True

    async def forward_commands(self) -> None:
        assert self.process.stdin is not None
        async for command in self._to_send:
            await self.process.stdin.send_all(command)

    async def stop(self) -> None:
        await stop_process(self.process)


async def stop_process(process: trio.Process) -> None:
    """End of file on its stdin; then SIGTERM, then SIGKILL if it does not go. Shielded: it
    runs when the demo is being cancelled."""
    with trio.CancelScope(shield=True):
        if process.stdin is not None:
            await process.stdin.aclose()
        with trio.move_on_after(CHILD_STOP_S):
            await process.wait()
            return
        for send_signal in (process.terminate, process.kill):
            send_signal()
            with trio.move_on_after(CHILD_STOP_S):
                await process.wait()
                return


async def _first_line(process: trio.Process) -> str:
    assert process.stdout is not None
    data = b""
    while not data.endswith(b"\n"):
        chunk = await process.stdout.receive_some(1024)
        if not chunk:
            code = await process.wait()
            raise RuntimeError(f"a demo process exited ({code}) before it was ready")
        data += chunk
    return data.decode().strip()


class Children:
    """The demo's children, started in a nursery that outlives them all."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    async def start_all(self, specs: Sequence[tuple[str, dict[str, Any]]]) -> list[Child]:
        """Start them at once (each takes ~0.5 s of imports); return them in order."""
        started: list[Child | None] = [None] * len(specs)

        async def one(index: int, kind: str, config: dict[str, Any]) -> None:
            started[index] = await self._nursery.start(self._keep, kind, config)

        async with trio.open_nursery() as starting:
            for index, (kind, config) in enumerate(specs):
                starting.start_soon(one, index, kind, config)
        return [c for c in started if c is not None]

    async def _keep(
        self, kind: str, config: dict[str, Any], *, task_status: trio.TaskStatus[Child]
    ) -> None:
        """`python -m app.cli.demo KIND CONFIG`, running until cancelled, then stopped."""
        command = [sys.executable, "-m", "app.cli.demo", kind, json.dumps(config)]
        process = await trio.lowlevel.open_process(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        try:
            with trio.fail_after(CHILD_START_S):
                ready = await _first_line(process)
            task_status.started(Child(process, ready))
            await trio.sleep_forever()
        finally:
            await stop_process(process)


@asynccontextmanager
async def children() -> AsyncIterator[Children]:
    """Children that live until the block ends; then each is told to stop."""
    async with trio.open_nursery() as nursery:
        yield Children(nursery)
        nursery.cancel_scope.cancel()


def _sim_config(settings: Settings, seed: int, models: tuple[str, ...]) -> dict[str, Any]:
    # Token forwarding needs backends that tokenize exactly as the proxy does.
    tokenize_with = (settings.tokenizer or "default") if settings.forward == "tokens" else "words"
    sim = SimSettings(port=0, seed=seed, models=models, tokenize_with=tokenize_with)
    return dataclasses.asdict(sim)


async def demo_main(settings: Settings) -> None:
    count = settings.demo_backends
    served = [(LARGE,)] * (count - 1) + [(SMALL,) if count > 1 else (LARGE, SMALL)]
    # Exits last: the simulated GPUs stop once the proxy has drained.
    async with children() as started:
        sims = await started.start_all(
            [("sim", _sim_config(settings, seed, names)) for seed, names in enumerate(served)]
        )
        urls = [sim.ready for sim in sims]
        models = demo_models(urls)
        sluice = Sluice(
            dataclasses.replace(
                settings, models=models, shutdown_grace=min(settings.shutdown_grace, 1.0)
            )
        )
        # The page's burst button exists from the start; the traffic it asks comes next.
        traffic_child: list[Child] = []
        sluice.request_burst = lambda: any(c.send_nowait(BURST) for c in traffic_child)
        async with trio.open_nursery() as nursery:
            await nursery.start(stop_on_signal, sluice.shutdown, nursery.cancel_scope)
            proxy_url, dashboard_url = await nursery.start(
                run_then_cancel, sluice, nursery.cancel_scope
            )
            traffic_config = {
                "proxy_url": proxy_url,
                "rate": settings.demo_rps,
                "burst_interval": settings.demo_burst_interval,
                "models": [LARGE, SMALL, ALIAS],
            }
            (traffic,) = await started.start_all([("traffic", traffic_config)])
            traffic_child.append(traffic)
            nursery.start_soon(traffic.forward_commands)
            for model in models:
                print(f"Sluice demo: {model.name} on {', '.join(model.backends)}", flush=True)
            print_urls(proxy_url, dashboard_url)
            print("Press Ctrl-C to stop.", flush=True)
            await sluice.shutdown.wait()
            await traffic.stop()  # no new requests while the proxy drains


def run_demo(settings: Settings) -> int:
    return run_until_stopped(demo_main, settings)


# --- the children ----------------------------------------------------------------------------


async def _child_main(kind: str, config: dict[str, Any]) -> None:
    async with trio.open_nursery() as nursery:
        traffic: DemoTraffic | None = None
        if kind == "sim":
            settings = SimSettings(**{**config, "models": tuple(config["models"])})
            ready = await nursery.start(serve_sim, settings)
        else:
            traffic = DemoTraffic(config["rate"], config["burst_interval"], config["models"])
            nursery.start_soon(traffic.run, config["proxy_url"])
            ready = "traffic"
        print(ready, flush=True)
        await _follow_parent(traffic)
        nursery.cancel_scope.cancel()


async def _follow_parent(traffic: DemoTraffic | None) -> None:
    """Commands from the parent until its end of the pipe closes (it stopped, or died)."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stdin:
        pending = b""
        while chunk := await stdin.receive_some(1024):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line == BURST.strip() and traffic is not None:
                    traffic.request_burst()


def _child(arguments: Sequence[str]) -> int:
    kind, config = arguments
    if kind not in ("sim", "traffic"):
        raise SystemExit(f"python -m app.cli.demo: unknown part {kind!r}")
    # The demo's scaffolding yields a contended core to the proxy, whose loop is what the page
    # is about. Measured on 2 shared cores, 3 alternating 45 s runs each: children at nice
    # 19 gave the proxy's lag p99 4.5-8.7 ms, at nice 10 8.0-16 ms.
    os.nice(CHILD_NICENESS)
    # Ctrl-C reaches the whole process group: a child lets its parent decide (the proxy
    # drains its requests, which still need their simulated GPUs, then closes the pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trio.run(_child_main, kind, json.loads(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(sys.argv[1:]))
