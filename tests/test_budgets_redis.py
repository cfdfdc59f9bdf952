"""Shared per-key budgets against a real Redis (Debian's redis-server on a free port): two
Sluices with `--redis-url` admit one key's budget between them, not twice; Redis killed,
no request fails (each proxy falls back to its share of the budget), `sluice_budget_redis_up`
drops to 0 and the dashboard warns; Redis back, the budgets are shared again."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import StartSim, StartSluice, wait_until

REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"
if not os.path.exists(REDIS):
    if os.environ.get("CI"):
        raise RuntimeError(f"CI needs {REDIS} (.ci/run installs redis-server)")
    pytest.skip(f"needs {REDIS} (apt-get install -y redis-server)", allow_module_level=True)

EPHEMERAL = ("--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
BUDGET = 3000  # tokens per minute for the one key
KEY = {"authorization": "Bearer team-a"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [REDIS, "--port", str(self.port), *EPHEMERAL],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = 100
        while deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            deadline -= 1
            time.sleep(0.05)  # polling the new process (tests call this in a thread)
        raise RuntimeError("redis-server did not answer")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


async def chat(client: httpx.AsyncClient, proxy: str, words: int = 60) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * words}]}
    return await client.post(proxy + "/v1/chat/completions", json=body, headers=KEY)


def used(response: httpx.Response) -> int:
    usage: dict[str, Any] = response.json()["usage"]
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


async def budgets_of(client: httpx.AsyncClient, dashboard: str) -> dict[str, Any]:
    snapshot = (await client.get(dashboard + "/api/snapshot")).json()
    result: dict[str, Any] = snapshot["budgets"]
    result["notices"] = snapshot["notices"]
    return result


async def test_two_proxies_share_one_budget_and_survive_redis_going_away(
    start_sim: StartSim,
    start_sluice: StartSluice,
    client: httpx.AsyncClient,
    redis_server: RedisServer,
) -> None:
    sim = await start_sim()
    options: dict[str, Any] = {
        "tokens_per_minute": BUDGET,
        "redis_url": redis_server.url,
        "budget_sync_interval": 0.05,
    }
    proxies = [await start_sluice([sim.url], **options) for _ in range(2)]

    async def both_synced() -> bool:
        for proxy in proxies:
            budgets = await budgets_of(client, proxy.dashboard_url)
            if not budgets["redis_up"] or budgets["replicas"] != 2:
                return False
        return True

    await wait_until(both_synced, timeout=10)

    admitted = 0
    refused = 0
    for turn in range(200):
        response = await chat(client, proxies[turn % 2].proxy_url)
        assert response.status_code in (200, 429), response.text
        if response.status_code == 429:
            assert response.json()["error"]["code"] == "tokens_per_minute"
            refused += 1
            if refused >= 6:
                break
        else:
            admitted += used(response)
        await trio.sleep(0.02)  # a client's pace: the syncs run between requests
    # Two proxies, one budget: not two.
    assert BUDGET * 0.8 <= admitted <= BUDGET * 1.1
    assert refused >= 6

    # Redis gone: nothing fails, each proxy admits its own share of a fresh key's budget.
    redis_server.stop()

    async def fell_back() -> bool:
        budgets = await budgets_of(client, proxies[0].dashboard_url)
        return not budgets["redis_up"] and bool(budgets["notices"])

    await wait_until(fell_back, timeout=10)
    metrics = (await client.get(proxies[0].proxy_url + "/metrics")).text
    assert "sluice_budget_redis_up 0.0" in metrics
    notice = (await budgets_of(client, proxies[0].dashboard_url))["notices"][0]["text"]
    assert "unreachable" in notice and "1/2" in notice
    statuses: list[int] = []
    fallback_admitted = 0
    other_key = {"authorization": "Bearer team-b"}
    for _ in range(40):
        body = {"model": "m", "messages": [{"role": "user", "content": "word " * 60}]}
        response = await client.post(
            proxies[0].proxy_url + "/v1/chat/completions", json=body, headers=other_key
        )
        statuses.append(response.status_code)
        if response.status_code == 200:
            fallback_admitted += used(response)
    assert set(statuses) <= {200, 429}
    assert statuses[0] == 200 and statuses[-1] == 429
    assert fallback_admitted <= BUDGET / 2 * 1.1  # one proxy's share of two

    # Redis back: shared again, with what was used meanwhile added.
    await trio.to_thread.run_sync(redis_server.start)

    async def shared_again() -> bool:
        return bool((await budgets_of(client, proxies[0].dashboard_url))["redis_up"])

    await wait_until(shared_again, timeout=10)
    assert (await budgets_of(client, proxies[0].dashboard_url))["notices"] == []
