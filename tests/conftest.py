"""Shared fixtures: simulated backends and a running Sluice, all on 127.0.0.1 port 0."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio

from app.cli.sluice import Sluice
from app.config import Settings
from app.http.server import Handler, HttpServer
from app.preprocess.tokenizer_loading import TokenizerLike
from app.sim.server import SimServer, create_sim_app, serve_sim
from app.sim.settings import SimSettings

# The model the test backends serve (any other name gets vLLM's 404).
MODEL = "m"

FAST_SIM = SimSettings(
    port=0,
    models=(MODEL,),
    prefill_overhead=0.0005,
    prefill_per_token=0.000001,
    inter_token_latency=0.0005,
)

TEST_SETTINGS = Settings(
    port=0,
    dashboard_port=0,
    health_check_interval=0.2,
    health_check_timeout=1.0,
    breaker_failures=1,
    breaker_cooldown=0.5,
    connect_timeout=1.0,
    first_byte_timeout=5.0,
    idle_timeout=2.0,
    shutdown_grace=1.0,
)

StartSim = Callable[..., Awaitable["SimHandle"]]
StartBackend = Callable[[Handler], Awaitable[str]]
StartSluice = Callable[..., Awaitable["RunningSluice"]]
StartSluiceOnASim = Callable[..., Awaitable["RunningSluice"]]


@dataclasses.dataclass
class RunningSluice:
    sluice: Sluice
    proxy_url: str
    dashboard_url: str
    cancel_scope: trio.CancelScope


@dataclasses.dataclass
class SimHandle:
    url: str
    cancel_scope: trio.CancelScope
    app: SimServer

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        """Stop the server: its socket closes and connections are refused."""
        self.cancel_scope.cancel()


@pytest.fixture
def start_sim(nursery: trio.Nursery) -> StartSim:
    async def start(base: SimSettings = FAST_SIM, **overrides: Any) -> SimHandle:
        settings = dataclasses.replace(base, **overrides)
        cancel_scope = trio.CancelScope()
        app = create_sim_app(settings)

        async def run(*, task_status: trio.TaskStatus[str]) -> None:
            with cancel_scope:
                await serve_sim(settings, app=app, task_status=task_status)

        url: str = await nursery.start(run)
        return SimHandle(url, cancel_scope, app)

    return start


@pytest.fixture
def start_backend(nursery: trio.Nursery) -> StartBackend:
    """Serve a hand-written handler (a backend with some quirk) on the server the simulated
    backend runs on (app/http/server.py); returns its base URL."""

    async def start(handler: Handler) -> str:
        url: str = await nursery.start(HttpServer(handler).serve, "127.0.0.1", 0, 128)
        return url

    return start


@pytest.fixture
def start_sluice(nursery: trio.Nursery) -> StartSluice:
    async def start(
        backends: list[str], tokenizer: TokenizerLike | None = None, **overrides: Any
    ) -> RunningSluice:
        settings = dataclasses.replace(TEST_SETTINGS, backends=tuple(backends), **overrides)
        sluice = Sluice(settings, tokenizer=tokenizer)
        cancel_scope = trio.CancelScope()

        async def run(*, task_status: trio.TaskStatus[tuple[str, str]]) -> None:
            with cancel_scope:
                await sluice.run(task_status=task_status)

        proxy_url, dashboard_url = await nursery.start(run)
        return RunningSluice(sluice, proxy_url, dashboard_url, cancel_scope)

    return start


@pytest.fixture
def start_sluice_on_a_sim(start_sim: StartSim, start_sluice: StartSluice) -> StartSluiceOnASim:
    """A Sluice in front of one simulated backend of FAST_SIM; the keywords are Sluice's."""

    async def start(tokenizer: TokenizerLike | None = None, **overrides: Any) -> RunningSluice:
        sim = await start_sim()
        return await start_sluice([sim.url], tokenizer, **overrides)

    return start


@pytest.fixture
async def client() -> Any:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        yield http


async def set_faults(client: httpx.AsyncClient, sim_url: str, **faults: Any) -> None:
    response = await client.post(f"{sim_url}/sim/faults", json=faults)
    response.raise_for_status()


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll observable state (never a fixed sleep) until it holds, or fail after `timeout`."""
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(0.01)


class FakeTraffic:
    """The router as the fleet's watchers see it: requests that asked, and the next one."""

    def __init__(self) -> None:
        self.requests = 0
        self.busy = False
        self._sent = trio.Event()

    def send(self) -> None:
        self.requests += 1
        self._sent.set()
        self._sent = trio.Event()

    async def next_request(self) -> None:
        await self._sent.wait()
