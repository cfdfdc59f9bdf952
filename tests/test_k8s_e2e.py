"""Kubernetes discovery end to end: an in-process Sluice started with `--discover-k8s` only,
reading a kubeconfig the test writes ($KUBECONFIG) that names the stand-in API server
(load/kube_api.py), whose pods are simulated engines on their own loopback addresses
(127.0.0.x, each pod's port in its `sluice.io/port` annotation). A rolling replacement of
8 pods one at a time (the new pod Ready after a while, then the old one deleted) under
streamed traffic answers every request, and no request reaches a pod before it is Ready or
after its deletion was seen (beyond those already in flight)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from load.kube_api import KubeApi, kubeconfig, serving
from tests.conftest import MODEL, SimHandle, StartSim, StartSluice, wait_until

NS = "inference"
PODS = 8
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a story."}],
    "max_tokens": 24,
    "stream": True,
}


def chats(sim: SimHandle) -> int:
    return sum(sim.app.prompts_by_form.values())


async def one_stream(client: httpx.AsyncClient, url: str, tally: dict[str, int]) -> None:
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=CHAT) as answer:
            lines = [line async for line in answer.aiter_lines() if line.startswith("data: ")]
        whole = answer.status_code == 200 and lines[-1:] == ["data: [DONE]"]
    except httpx.HTTPError:
        whole = False
    tally["answered" if whole else "lost"] += 1


async def traffic(client: httpx.AsyncClient, url: str, tally: dict[str, int]) -> None:
    while True:
        await one_stream(client, url, tally)


class Fleet:
    """Pods of the stand-in, each a simulated engine on its own loopback address."""

    def __init__(self, api: KubeApi, start_sim: StartSim) -> None:
        self.api, self.start_sim = api, start_sim
        self.sims: dict[str, SimHandle] = {}
        self.before_ready: dict[str, int] = {}
        self.count = 0

    async def add(self) -> str:
        self.count += 1
        name, ip = f"vllm-{self.count}", f"127.0.0.{self.count + 1}"
        sim = await self.start_sim(host=ip, port=0, inter_token_latency=0.004)
        self.sims[name] = sim
        annotations = {"sluice.io/port": str(sim.port)}
        self.api.add(NS, name, ip, {"app": "vllm"}, annotations=annotations)
        return name

    def ready(self, name: str) -> None:
        self.before_ready[name] = chats(self.sims[name])
        self.api.set_ready(NS, name)


@pytest.mark.parametrize("graceful", [True, False])
async def test_a_rolling_replacement_under_streams_loses_nothing(
    start_sim: StartSim,
    start_sluice: StartSluice,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    graceful: bool,
) -> None:
    async with serving() as api:
        config = tmp_path / "kubeconfig"
        config.write_text(kubeconfig(api, NS))
        monkeypatch.setenv("KUBECONFIG", str(config))
        fleet = Fleet(api, start_sim)
        for _ in range(PODS):
            fleet.ready(await fleet.add())
        sluice = await start_sluice([], discover_k8s=f"{NS}/app=vllm", drain_timeout=10.0)
        pool = sluice.sluice.router.pool

        async def serving_all(names: list[str]) -> bool:
            now = trio.current_time()
            found = [pool.find(fleet.sims[n].url) for n in names]
            return all(b is not None and b.takes_traffic(now) for b in found)

        await wait_until(lambda: serving_all(list(fleet.sims)), timeout=10)
        tally = {"answered": 0, "lost": 0}
        leaks: dict[str, Any] = {}
        async with (
            httpx.AsyncClient(timeout=30, trust_env=False) as client,
            trio.open_nursery() as nursery,
        ):
            for _ in range(6):
                nursery.start_soon(traffic, client, sluice.proxy_url, tally)
            for old in list(fleet.sims)[:PODS]:
                new = await fleet.add()
                await trio.sleep(0.1)  # not Ready for a while: it must get nothing
                fleet.ready(new)
                await wait_until(lambda new=new: serving_all([new]), timeout=10)
                api.delete(NS, old, graceful=graceful)
                backend = pool.find(fleet.sims[old].url)
                await wait_until(lambda old=old: _left(pool, fleet.sims[old].url), timeout=10)
                leaks[old] = (chats(fleet.sims[old]), backend.inflight if backend else 0)
            await wait_until(lambda: _answered(tally, 40), timeout=10)
            nursery.cancel_scope.cancel()
        assert tally["lost"] == 0 and tally["answered"] > 40
        assert all(count == 0 for count in fleet.before_ready.values()), fleet.before_ready
        for old, (at_leave, inflight) in leaks.items():
            assert at_leave > 0, old  # it served before it left
            assert chats(fleet.sims[old]) <= at_leave + inflight, old  # and nothing new after
        assert api.requests["list"] == 1


async def _left(pool: Any, url: str) -> bool:
    backend = pool.find(url)
    return backend is None or backend in {d.backend for d in pool.draining}


async def _answered(tally: dict[str, int], count: int) -> bool:
    return tally["answered"] >= count
